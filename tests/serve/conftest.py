"""The serving tests' tiny model: a random HF Llama (GQA 8:2), saved and loaded."""

import pytest

import kvjax.models as models
from tests.models import hf_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    m = hf_tiny.build("llama_gqa")
    d = tmp_path_factory.mktemp("llama_gqa")
    m.save_pretrained(d)
    return models.load(str(d))
