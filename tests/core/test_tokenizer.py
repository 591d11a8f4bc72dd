"""contextkit's tokenizer (tokenizers + jinja2, no transformers) against transformers.AutoTokenizer on the
packaged models' own directories: the same ids, text and rendered chats, on real passages, agent-trace
messages and arbitrary unicode."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from contextkit.core.errors import ModelError
from contextkit.core.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # transformers loads Gemma's 262k-token tokenizer in ~10 s: make test only
MODELS = ["smol_dir", "gemma_dir"]


@pytest.fixture(scope="module", params=MODELS)
def pair(request):
    model_dir = request.getfixturevalue(request.param)
    return Tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _trace_messages(shared_data, repo) -> list[list[dict[str, str]]]:
    """Real multi-turn agent messages (the shared SWE-agent traces, else the bundled example)."""
    path = shared_data / "traces" / "swe_agent_traces.jsonl"
    if not path.is_file():
        doc = json.loads((repo / "examples" / "question.json").read_text())
        return [[{"role": "user", "content": d["text"]} for d in doc["documents"]]]
    chats = []
    for line in path.read_text().splitlines()[:3]:
        row = json.loads(line)
        msgs = [m for m in row.get("messages", row.get("trajectory", [])) if isinstance(m, dict)]
        chats.append([{"role": m["role"] if m.get("role") in ("system", "user", "assistant") else "user",
                       "content": str(m.get("content", ""))} for m in msgs[:8]])
    return [c for c in chats if c]


def test_real_passages_encode_and_decode_alike(pair, passage_text):
    ours, theirs = pair
    for chunk in [passage_text[i:i + 3000] for i in range(0, 30000, 3000)]:
        ids = ours.encode(chunk)
        assert ids == theirs(chunk, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        with_specials = ours.encode(chunk, add_special_tokens=True)
        assert with_specials == theirs(chunk, add_special_tokens=True)["input_ids"]
    assert ours.vocab_size == len(theirs)


def test_real_chats_render_alike(pair, shared_data, repo):
    ours, theirs = pair
    assert ours.has_chat_template == bool(getattr(theirs, "chat_template", None))
    chats = _trace_messages(shared_data, repo)
    assert chats
    if not ours.has_chat_template:
        with pytest.raises(ModelError, match="no chat template"):
            ours.render_chat(chats[0])
        return
    for chat in chats:
        assert ours.render_chat(chat) == theirs.apply_chat_template(chat, tokenize=False,
                                                                    add_generation_prompt=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=0, max_size=200))
def test_any_unicode_text_round_trips_like_transformers(pair, text):
    ours, theirs = pair
    ids = ours.encode(text)
    assert ids == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_a_directory_without_tokenizer_json_says_what_to_point_at(tmp_path):
    with pytest.raises(ModelError, match="tokenizer.json"):
        Tokenizer(tmp_path)


def test_template_features_render_as_transformers_does(smol_dir, tmp_path):
    """{% generation %} blocks, loop controls, tojson and raise_exception, in a template of our own beside
    the real tokenizer files."""
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
        "{% if loop.index > 3 %}{% break %}{% endif %}<{{ m['role'] }}>{{ m['content'] | tojson }}"
        "{% if m['role'] == 'assistant' %}{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{{ eos_token }}{% endif %}")
    ours, theirs = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    chat = [{"role": "system", "content": "be \"brief\" <ok>"}, {"role": "user", "content": "héllo"},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "dropped by break"}]
    assert ours.render_chat(chat) == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    with pytest.raises(Exception, match="no tools here"):
        ours.render_chat([{"role": "tool", "content": "x"}])
