"""The serving tests' tiny model: a random HF Llama (GQA 8:2), saved and loaded; and absl's
log handler kept off pytest's capture while a server is configured."""

import sys

import pytest

import kvjax.models as models
from tests.models import hf_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    m = hf_tiny.build("llama_gqa")
    d = tmp_path_factory.mktemp("llama_gqa")
    m.save_pretrained(d)
    return models.load(str(d))


@pytest.fixture(autouse=True)
def _absl_handler_on_the_real_stderr(monkeypatch):
    """Building a `uvicorn.Config` applies uvicorn's logging dictConfig, which closes every
    existing log handler. absl's handler (installed when flax or orbax is imported, here at
    collection) then closes its stream unless that stream is the current sys.stderr -- and
    under `capsys` it is not: it is pytest's session-wide capture, which every later test
    of the worker then finds closed ("lost sys.stderr"). For each serving test the handler
    writes to the process's own stderr, which it never closes."""
    absl_logging = sys.modules.get("absl.logging")
    if absl_logging is not None:
        monkeypatch.setattr(absl_logging.get_absl_handler().python_handler, "stream",
                            sys.__stderr__)
    yield
