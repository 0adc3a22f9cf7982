// The echorl dashboard: one snapshot from the broker every few seconds (server-sent events),
// drawn into five views. Read-only; nothing here is fetched from anywhere but the broker.
"use strict";

const $ = (id) => document.getElementById(id);
let snap = null;
let sortKey = "consumed", sortDown = true;

const COLUMNS = [
  ["name", "name"], ["id", "id"], ["state", "state"], ["standing", "standing"],
  ["tokens_per_s", "tokens/s"], ["version_held", "version"], ["lag", "lag"],
  ["fetch_s", "fetch s"], ["pushed", "pushed"], ["consumed", "consumed"], ["share", "share"],
  ["stale", "stale"], ["refused", "refused"], ["lapsed", "lapsed"], ["leased", "holds"],
  ["cost_per_hour", "cost/h"], ["spent", "spent"], ["cost_per_mtoken", "cost/Mtok"],
];

function text(tag, value, cls) {
  const el = document.createElement(tag);
  el.textContent = value === null || value === undefined ? "-" : String(value);
  if (cls) el.className = cls;
  return el;
}

function fmt(v, digits) {
  if (v === null || v === undefined) return "-";
  return typeof v === "number" && !Number.isInteger(v) ? v.toFixed(digits ?? 2) : v;
}

function show(view) {
  document.querySelectorAll("nav button").forEach((b) => b.classList.toggle("on", b.dataset.view === view));
  document.querySelectorAll(".view").forEach((v) => v.classList.toggle("on", v.id === view));
}

document.querySelectorAll("nav button").forEach((b) => b.addEventListener("click", () => show(b.dataset.view)));
$("filter").addEventListener("input", () => snap && drawSwarm());

function rows() {
  const st = snap.status, latest = st.latest_version;
  const total = st.samplers.reduce((n, s) => n + s.consumed, 0);
  return st.samplers.map((s) => ({
    ...s,
    lag: s.version_held === null ? null : latest - s.version_held,
    share: total ? s.consumed / total : null,
  }));
}

function drawSwarm() {
  const st = snap.status;
  $("warnings").replaceChildren(...snap.warnings.map((w) => text("li", w)));
  $("holding").textContent = snap.holding.length ? "holding jobs now: " + snap.holding.join("; ") : "";
  const head = document.createElement("tr");
  for (const [key, label] of COLUMNS) {
    const th = text("th", label + (key === sortKey ? (sortDown ? " ▾" : " ▴") : ""));
    th.addEventListener("click", () => {
      sortDown = key === sortKey ? !sortDown : true;
      sortKey = key;
      drawSwarm();
    });
    head.append(th);
  }
  $("samplers").tHead.replaceChildren(head);
  const needle = $("filter").value.toLowerCase();
  const shown = rows()
    .filter((s) => !needle || [s.name, s.state, s.standing, s.id].join(" ").toLowerCase().includes(needle))
    .sort((a, b) => {
      const x = a[sortKey] ?? -Infinity, y = b[sortKey] ?? -Infinity;
      return (x < y ? -1 : x > y ? 1 : 0) * (sortDown ? -1 : 1);
    });
  $("samplers").tBodies[0].replaceChildren(
    ...shown.map((s) => {
      const tr = document.createElement("tr");
      tr.className = s.state + " pick";
      tr.dataset.id = s.id;
      for (const [key] of COLUMNS) {
        const v = key === "share" ? (s.share === null ? null : (100 * s.share).toFixed(1) + "%") : fmt(s[key], key === "tokens_per_s" ? 0 : 2);
        tr.append(text("td", v));
      }
      tr.addEventListener("click", () => openSampler(s));
      return tr;
    }),
  );
}

async function openSampler(s) {
  const reply = await fetch("/ui/api/sampler/" + encodeURIComponent(s.id));
  const groups = await reply.json();
  const table = document.createElement("table");
  const head = document.createElement("tr");
  ["job", "version", "state", "rewards", "consumed at step", "trainer log-probs"].forEach((h) => head.append(text("th", h)));
  table.append(head);
  for (const g of groups) {
    const tr = document.createElement("tr");
    tr.className = "pick" + (g.trainer_logprobs ? " traced" : "");
    tr.dataset.job = g.job_id;
    [g.job_id, g.version, g.flat ? "flat" : g.state, g.rewards ? g.rewards.map((r) => fmt(r)).join(" ") : "-",
      g.consumed_step, g.trainer_logprobs ? "yes" : ""].forEach((v) => tr.append(text("td", v)));
    tr.addEventListener("click", () => openGroup(g.job_id));
    table.append(tr);
  }
  $("sampler").replaceChildren(text("h3", `${s.name} (${s.id}): its ${groups.length} most recent groups`), table);
}

async function openGroup(jobId) {
  const g = await (await fetch("/ui/api/group/" + jobId)).json();
  const out = [text("h3", `job ${g.job_id}: version ${g.version}, ${g.state}` +
    (g.consumed_step === null ? "" : ` at step ${g.consumed_step}`) + `, sampler ${g.sampler}`)];
  out.push(text("pre", g.prompt));
  g.completions.forEach((c, k) => {
    const box = document.createElement("div");
    box.className = "completion";
    const reward = g.rewards ? fmt(g.rewards[k], 3) : "-";
    box.append(text("div", `completion ${k}: reward ${reward} (claimed ${fmt(g.claimed[k], 3)})`));
    const line = document.createElement("div");
    const mine = c.trainer_logprobs;
    c.tokens.forEach((t, i) => {
      const lp = c.logprobs[i];
      const span = text("span", t, "tok");
      if (mine) {  // red where the sampler and the trainer disagree on the token
        const gap = Math.min(1, Math.abs(lp - mine[i]));
        span.style.background = `rgba(210, 60, 60, ${0.08 + 0.7 * gap})`;
        span.title = `behaviour log-prob ${fmt(lp, 4)}, trainer ${fmt(mine[i], 4)}`;
      } else {  // the sampler's probability of the token: pale = unsure
        span.style.background = `rgba(60, 140, 220, ${0.15 + 0.6 * Math.exp(lp ?? 0)})`;
        span.title = `behaviour log-prob ${fmt(lp, 4)}`;
      }
      line.append(span);
    });
    box.append(line);
    if (mine) {
      const gaps = mine.map((m, i) => Math.abs(c.logprobs[i] - m));
      box.append(text("div", `mean |behaviour - trainer| log-prob ${fmt(gaps.reduce((a, b) => a + b, 0) / gaps.length, 4)}`, "gap"));
    }
    out.push(box);
  });
  out.push(text("p", g.completions.some((c) => c.trainer_logprobs)
    ? "Token colour: how far the sampler's log-prob is from the trainer's (hover for both)."
    : "Token colour: the sampler's own probability of each token (hover for its log-prob); " +
      "the trainer sends its own for one group a step."));
  $("group").replaceChildren(...out);
  show("group");
}

let openVersion = null;

function names() {
  return Object.fromEntries(snap.status.samplers.map((s) => [s.id, s.name]));
}

function mb(bytes) {
  return bytes === null || bytes === undefined ? "-" : (bytes / 1e6).toFixed(bytes < 1e7 ? 2 : 0) + " MB";
}

function drawVersions() {
  const st = snap.status, alive = st.samplers.filter((s) => s.state === "alive");
  const holders = {};
  alive.forEach((s) => { holders[s.version_held] = (holders[s.version_held] || 0) + 1; });
  $("held").tBodies[0].replaceChildren(...snap.versions.map((v) => {
    const tr = document.createElement("tr");
    tr.className = "pick";
    tr.dataset.version = v.version;
    const times = Object.values(v.arrived).map((a) => a[0]).sort((a, b) => a - b);
    const at = (q) => (times.length ? fmt(times[Math.min(times.length - 1, Math.floor(q * times.length))], 2) : "-");
    const from = Object.values(v.from);
    const peers = from.filter((f) => f !== "@broker").length;
    tr.append(text("td", v.version), text("td", `${(snap.time - v.published).toFixed(1)} s ago`),
      text("td", mb(v.bytes) + (v.delta_bytes ? ` (delta ${mb(v.delta_bytes)})` : "")),
      text("td", `${holders[v.version] || 0} of ${alive.length}`),
      text("td", times.length ? `${at(0)} / ${at(0.5)} / ${at(1)} (${times.length})` : "-"),
      text("td", from.length ? `broker ${from.length - peers}, peers ${peers}` : "-"));
    tr.addEventListener("click", () => { openVersion = v.version; drawTree(); });
    return tr;
  }));
  const src = Object.entries(st.weight_sources).map(([k, n]) => `${k}: ${n}`).join(", ");
  $("sources").textContent = `latest version ${st.latest_version}; versions fetched from ${src || "nobody yet"}` +
    " (click a version for its fan-out tree)";
  drawTree();
}

function drawTree() {
  const v = snap.versions.find((x) => x.version === openVersion);
  if (!v) { $("tree").replaceChildren(); return; }
  const who = names(), takers = {};
  Object.entries(v.from).forEach(([taker, source]) => (takers[source] = takers[source] || []).push(taker));
  const node = (id, seen) => {
    const li = document.createElement("li");
    const a = v.arrived[id];
    li.append(text("span", id === "@broker" ? "broker" : `${who[id] || id}` +
      (a ? `: arrived ${fmt(a[0], 2)} s after publish (fetch and load ${fmt(a[1], 2)} s)` : ": not arrived yet")));
    const below = (takers[id] || []).filter((t) => !seen.has(t));
    if (below.length) {
      const ul = document.createElement("ul");
      below.forEach((t) => { seen.add(t); ul.append(node(t, seen)); });
      li.append(ul);
    }
    return li;
  };
  const root = document.createElement("ul");
  root.className = "tree";
  root.append(node("@broker", new Set(["@broker"])));
  $("tree").replaceChildren(text("h3", `version ${v.version}: who fetched it from whom`), root);
}

function line(svg, series, colours) {
  const all = series.flat().filter((p) => p[1] !== null);
  if (!all.length) { svg.replaceChildren(); return; }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  const y0 = Math.min(0, ...ys), y1 = Math.max(...ys, y0 + 1e-9);
  const X = (x) => 40 + (750 * (x - x0)) / (x1 - x0), Y = (y) => 185 - (170 * (y - y0)) / (y1 - y0);
  const ns = "http://www.w3.org/2000/svg", parts = [];
  series.forEach((pts, k) => {
    const path = document.createElementNS(ns, "path");
    path.setAttribute("d", pts.filter((p) => p[1] !== null).map((p, i) => (i ? "L" : "M") + X(p[0]) + " " + Y(p[1])).join(" "));
    path.setAttribute("stroke", colours[k]);
    parts.push(path);
  });
  for (const [v, y] of [[y1, 20], [y0, 190]]) {
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", 2); label.setAttribute("y", y); label.setAttribute("font-size", 11);
    label.textContent = fmt(v, 2);
    parts.push(label);
  }
  svg.replaceChildren(...parts);
  svg.__scale = [X, Y];
}

function dots(svg, points, colour) {  // points over the chart `line` drew last
  if (!points.length || !svg.__scale) return;
  const ns = "http://www.w3.org/2000/svg", [X, Y] = svg.__scale;
  points.forEach(([x, y]) => {
    const c = document.createElementNS(ns, "circle");
    c.setAttribute("cx", X(x)); c.setAttribute("cy", Y(y)); c.setAttribute("r", 3);
    c.setAttribute("fill", colour);
    svg.append(c);
  });
}

function drawTraining() {
  const steps = snap.steps, trainer = snap.trainer;
  const evals = trainer.filter((r) => r["eval/reward"] !== undefined).map((r) => [r.step, r["eval/reward"]]);
  line($("reward"), [steps.map((s) => [s.step, s.reward]), evals], ["#2f6fb3", "#c60"]);
  dots($("reward"), evals, "#c60");
  const busy = trainer.filter((r) => r["trainer/wall_s"]).map((r) => [r.step, r["trainer/step_s"] / r["trainer/wall_s"]]);
  line($("busy"), [busy], ["#2f6fb3"]);
  const idle = trainer.map((r) => r["trainer/idle_s"]).filter((x) => x !== undefined).sort((a, b) => a - b);
  $("idle").textContent = idle.length
    ? `waiting for groups: median ${fmt(idle[Math.floor(idle.length / 2)], 3)} s, longest ${fmt(idle[idle.length - 1], 3)} s a step`
    : "";
  line($("staleness"), [steps.map((s) => [s.step, s.staleness]), steps.map((s) => [s.step, s.staleness_max])], ["#2f6fb3", "#c77"]);
  const hist = {};
  steps.forEach((s) => Object.entries(s.staleness_counts || {}).forEach(([k, n]) => { hist[k] = (hist[k] || 0) + n; }));
  const all = Object.values(hist).reduce((a, b) => a + b, 0);
  $("stale-hist").tBodies[0].replaceChildren(...Object.keys(hist).map(Number).sort((a, b) => a - b).map((k) => {
    const tr = document.createElement("tr");
    tr.append(text("td", k), text("td", hist[k]), text("td", (100 * hist[k] / all).toFixed(1) + "%"));
    return tr;
  }));
  const st = snap.status, last = trainer[trainer.length - 1] || {};
  const kv = (o) => Object.entries(o).map(([k, v]) => `${k}=${v}`).join(", ") || "none";
  $("buffer").textContent = `groups: ${kv(st.rollouts)}; jobs: ${kv(st.jobs)}; verifier: ${kv(st.verifier)}` +
    (last["verifier/errors"] ? `; verifier failures so far ${last["verifier/errors"]}` : "") +
    (st.verifier_error ? `; first verifier error: ${st.verifier_error}` : "");
}

function drawCapacity() {
  $("advice").replaceChildren(...(snap.capacity.length ? snap.capacity : ["no trainer step reported yet"]).map((l) => text("li", l)));
}

function draw(data) {
  snap = data;
  const st = snap.status;
  const counts = Object.entries(st.sampler_counts).map(([k, n]) => `${n} ${k}`).join(", ");
  $("run").textContent = `${st.mode} · version ${st.latest_version} · samplers: ${counts || "none"} · ` +
    `${snap.viewers} viewing · ${new Date(snap.time * 1000).toLocaleTimeString()}`;
  drawSwarm();
  drawVersions();
  drawTraining();
  drawCapacity();
}

fetch("/ui/api/snapshot").then((r) => r.json()).then(draw);
const events = new EventSource("/ui/events");
events.onmessage = (e) => { $("live").classList.add("on"); draw(JSON.parse(e.data)); };
events.onerror = () => $("live").classList.remove("on");
