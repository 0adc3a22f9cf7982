"""The dashboard in a real browser (Debian's chromium, driven by playwright) against a real
swarm: the page loads with the token and shows the K samplers, follows a new version without
a reload, shows a killed sampler lost, drills into a group, logs no console error; nothing of
it answers without a token. ECHORL_DOCS_SCREENSHOTS=docs/img keeps a screenshot of each view.
"""

import os
import re
import shutil
import signal
from pathlib import Path

import httpx
import pytest

from echorl.models import save_tiny_model
from tests.integration.conftest import (
    TRAINER,
    free_port,
    start_broker,
    start_sampler,
    start_trainer,
    stop_broker,
    wait_until,
)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
RUN = ["-o", "train.batch_prompts=4", "-o", "train.group_size=4", "-o", "broker.mode=async"]
RUN += ["-o", "sampling.max_new_tokens=8", "-o", "train.eval_prompts=4"]
RUN += ["-o", "train.drop_flat_groups=false"]


def test_nothing_of_the_dashboard_answers_without_a_token(broker):
    url, _ = broker
    for path in ("/ui", "/ui/static/app.js", "/ui/events", "/ui/api/snapshot", "/ui/api/group/0"):
        assert httpx.get(url + path).status_code == 401, path
    assert httpx.get(url + "/ui", params={"token": "x" * 32}).status_code == 401
    cookies = {"echorl_ui": "y" * 32}
    assert httpx.get(url + "/ui/api/snapshot", cookies=cookies).status_code == 401


@pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium: apt-get install chromium (scripts/test.sh does)"
)
def test_the_dashboard_follows_a_live_swarm_in_a_browser(tmp_path):
    from playwright.sync_api import sync_playwright

    model = save_tiny_model(tmp_path / "v0", "1m", seed=0)
    timeouts = ["-o", "broker.sampler_timeout=3"]
    proc, url = start_broker(tmp_path / "b", free_port(), *RUN, *timeouts)
    samplers = [start_sampler(url, model, f"box{k}", *RUN) for k in range(2)]
    trainer = start_trainer(url, model, tmp_path / "out", *RUN, "-o", "train.steps=400")
    shots = Path(os.environ.get("ECHORL_DOCS_SCREENSHOTS", tmp_path))
    errors = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("console", lambda m: m.type == "error" and errors.append(m.text))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url + f"/ui?token={TRAINER}")
            assert "token" not in page.url  # exchanged for a cookie, out of the address bar
            rows = page.locator("#samplers tbody tr")
            wait_until(lambda: rows.count() == 2, timeout=120, what="two samplers listed")
            run = page.locator("#run")
            wait_until(
                lambda: "version 2" in run.inner_text() or "version 3" in run.inner_text(),
                timeout=120,
                what="a published version",
            )
            seen = run.inner_text()
            wait_until(
                lambda: run.inner_text().split("·")[1] != seen.split("·")[1],
                timeout=60,
                what="the next version, without a reload",
            )
            page.screenshot(path=str(shots / "dashboard-swarm.png"))
            page.click("nav button[data-view=versions]")
            # A version's row (fetched from the broker); its tree names the sampler and when
            # the version reached it. (At 4 steps/s, each sampler skips versions.)
            arrived = page.locator("#held tbody tr", has_text=re.compile(r"\(1\)\s*broker 1"))
            wait_until(lambda: arrived.count() > 0, timeout=60, what="a version fetched")
            arrived.first.click()
            tree = page.locator("#tree").inner_text()
            assert re.search(r"box[01]: arrived [\d.]+ s after publish", tree), tree
            page.screenshot(path=str(shots / "dashboard-versions.png"))
            for view in ("training", "capacity"):
                page.click(f"nav button[data-view={view}]")
                page.screenshot(path=str(shots / f"dashboard-{view}.png"))
            # The training view draws the trainer's own numbers: its busy share, the eval.
            assert page.locator("#busy path").count() == 1
            assert "waiting for groups: median" in page.locator("#idle").inner_text()
            assert page.locator("#reward circle").count() >= 1  # step 0's held-out eval
            assert page.locator("#stale-hist tbody tr").count() >= 1
            page.click("nav button[data-view=swarm]")
            traced = page.locator("#sampler tr.traced[data-job]")  # with trainer log-probs

            def listed():  # the sampler's page again: its recent groups as they are now
                page.locator("#samplers tbody tr", has_text="box1").click()
                page.locator("#sampler tr[data-job]").first.wait_for(timeout=30_000)
                return traced.count() > 0

            wait_until(listed, timeout=60, what="a group the trainer sent log-probs of")
            traced.first.click()
            page.locator("#group .completion").first.wait_for(timeout=30_000)
            shown = page.locator("#group").inner_text()
            assert "completion 0: reward" in shown
            # On-policy (async, staleness <= 1, the same weights): the two agree closely.
            gaps = [
                float(x)
                for x in re.findall(r"mean \|behaviour - trainer\| log-prob ([\d.]+)", shown)
            ]
            assert len(gaps) == 4 and max(gaps) < 0.5, shown
            page.screenshot(path=str(shots / "dashboard-group.png"))
            page.click("nav button[data-view=swarm]")
            os.kill(samplers[0].pid, signal.SIGKILL)
            lost = page.locator("#samplers tbody tr.lost", has_text="box0")
            lost.wait_for(timeout=60_000)
            browser.close()
    finally:
        for p in [trainer, *samplers]:
            if p.poll() is None:
                p.terminate()
            p.communicate(timeout=60)
        stop_broker(proc)
    assert errors == []


def test_a_finished_runs_dashboard_is_served_from_its_files(tmp_path):
    """`echorl dashboard` on a finished run: the page is served from its files by a
    read-only broker: the trainer's steps, the accounts, a drill-down; a write is refused
    (405) and the run's database is the same bytes after."""
    import hashlib
    import json
    import subprocess
    import sys

    from tests.integration.conftest import echorl_run

    model = save_tiny_model(tmp_path / "v0", "1m", seed=0)
    out = tmp_path / "run"
    echorl_run(out, f"model.path={model}", "train.steps=3", *RUN[1::2])
    db = next(out.rglob("broker.sqlite"))
    digest = lambda: hashlib.sha256(db.read_bytes()).hexdigest()  # noqa: E731
    before = digest()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "echorl.cli", "dashboard", str(out), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        token = json.loads((out / "access.json").read_text())["trainer_token"]
        headers = {"Authorization": f"Bearer {token}"}

        def snapshot():
            try:
                return httpx.get(f"http://127.0.0.1:{port}/ui/api/snapshot", headers=headers).json()
            except httpx.HTTPError:
                return None

        snap = wait_until(snapshot, timeout=60, what="the finished run's dashboard")
        assert [s["step"] for s in snap["steps"]] == [0, 1, 2]  # as the trainer acked them
        assert snap["status"]["latest_version"] == 3
        assert snap["status"]["samplers"][0]["consumed"] == 3 * 4
        sampler_id = snap["status"]["samplers"][0]["id"]
        url = f"http://127.0.0.1:{port}"
        groups = httpx.get(f"{url}/ui/api/sampler/{sampler_id}", headers=headers).json()
        consumed = [g for g in groups if g["state"] == "consumed"]
        detail = httpx.get(f"{url}/ui/api/group/{consumed[0]['job_id']}", headers=headers)
        assert detail.status_code == 200 and len(detail.json()["completions"]) == 4
        refused = httpx.post(f"{url}/v1/samplers/lost", json={"name": "x"}, headers=headers)
        assert refused.status_code == 405 and "finished run" in refused.json()["detail"]
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert digest() == before  # nothing written: no sampler marked lost, no lease expired
    # A swarm started by hand has no access.json: its data dir and config, and a token of
    # this viewing's own (printed in the link).
    port = free_port()
    cmd = [sys.executable, "-m", "echorl.cli", "dashboard", "--data-dir", str(db.parent)]
    cmd += ["-c", str(out / "config.yaml"), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        token = re.search(r"/ui\?token=([0-9a-f]+)", line).group(1)
        headers = {"Authorization": f"Bearer {token}"}
        snap = wait_until(snapshot, timeout=60, what="the data dir's dashboard")
        assert [s["step"] for s in snap["steps"]] == [0, 1, 2]
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert digest() == before
