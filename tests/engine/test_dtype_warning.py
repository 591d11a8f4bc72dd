"""Asking the engine for bf16 on a CPU that emulates it is allowed, and says what it costs."""

import logging

import pytest

import contextkit.engine.model as model
from contextkit.engine.model import Engine


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_bf16_without_hardware_bf16_warns_and_fp32_never_does(smol_dir, monkeypatch, caplog, fast_bf16):
    monkeypatch.setattr(model, "cpu_has_fast_bf16", lambda: fast_bf16)
    with caplog.at_level(logging.WARNING, logger="contextkit.engine.model"):
        Engine.from_dir(smol_dir, "bfloat16")
        warned = [r.getMessage() for r in caplog.records]
        caplog.clear()
        Engine.from_dir(smol_dir, "float32")
        assert not caplog.records
    if fast_bf16:
        assert not warned
    else:
        assert len(warned) == 1 and 'use dtype "auto"' in warned[0]
