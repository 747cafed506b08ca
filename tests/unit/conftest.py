"""Fixtures of the HTTP unit tests: the scripted fake engine (tests/unit/openai_fake.py) over the
tiny checkpoint's config and tokenizer files, without weights."""

import pytest

from tests.unit.openai_fake import FakeEngine, write_checkpoint_files

FAKE_MAX_MODEL_LEN = 128


@pytest.fixture(scope="session")
def fake_model_dir(tmp_path_factory) -> str:
    return write_checkpoint_files(str(tmp_path_factory.mktemp("fake")))


@pytest.fixture
def engine(fake_model_dir) -> FakeEngine:
    """A fresh fake engine per test (its script and knobs are the test's to set)."""
    return FakeEngine(fake_model_dir, max_model_len=FAKE_MAX_MODEL_LEN)
