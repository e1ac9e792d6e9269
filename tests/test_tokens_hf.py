"""The router's tokenizers: the byte tokenizer behind the common interface, a Hugging Face
tokenizer.json built here with the ``tokenizers`` library itself (no download), its chat template
from tokenizer_config.json in a jinja2 sandbox, and off-loop tokenization of large prompts."""

from __future__ import annotations

import json
import threading

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from router_runtime.tokens import encode, render_chat
from router_runtime.tokens.chat import Reason, Untokenizable
from router_runtime.tokens.hf import HFTokenizer, TokenizerError
from router_runtime.tokens.tokenizer import (
    AsyncTokenizer,
    BytesTokenizer,
    ChatTemplateSpecError,
    Family,
    load_tokenizer,
)

CORPUS = [
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "you are a helpful assistant",
    "what is the capital of france",
    "paris is the capital",
]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "<|{{ m.role }}|> {{ m.content }} {{ eos_token }} "
    "{% endfor %}{% if tools %}<|tools|> {{ tools | tojson }} {% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer_dir(path, template=TEMPLATE, config_extra=None):
    """A WordLevel tokenizer trained on a few strings, with role markers and BOS/EOS as special tokens
    and a post-processor that adds BOS, as Llama-style tokenizers do."""
    specials = ["[UNK]", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tools|>"]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=specials))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "lstrip": False, "normalized": False, "special": True},
        "chat_template": template,
        **(config_extra or {}),
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


@pytest.fixture
def hf_dir(tmp_path):
    build_tokenizer_dir(tmp_path / "tok")
    return tmp_path / "tok"


def test_completion_encoding_adds_bos(hf_dir):
    raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tok = HFTokenizer.from_dir(str(hf_dir))
    bos = raw.token_to_id("<s>")
    ids = tok.encode("hello world")
    assert ids == [bos, raw.token_to_id("hello"), raw.token_to_id("world")]
    assert tok.prompt_ids("hello world", {}, unlocked=True) == tok.prompt_ids("hello world", {}) == ids


def test_chat_template_renders_with_generation_prompt_and_special_tokens(hf_dir):
    tok = HFTokenizer.from_dir(str(hf_dir))
    raw = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    messages = [
        {"role": "system", "content": "you are a helpful assistant"},
        {"role": "user", "content": "hello"},
    ]
    text = tok.render_chat({"messages": messages})
    assert text == "<s><|system|> you are a helpful assistant </s> <|user|> hello </s> <|assistant|>"
    ids = tok.chat_ids({"messages": messages})
    # The template carries the BOS: encoded without special tokens, so there is exactly one.
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert ids.count(raw.token_to_id("<s>")) == 1 and ids[0] == raw.token_to_id("<s>")
    assert tok.chat_ids({"messages": messages}, unlocked=True) == ids
    # A later turn extends the earlier prompt: the property prefix routing relies on.
    longer = [*messages, {"role": "assistant", "content": "paris"}, {"role": "user", "content": "world"}]
    assert tok.render_chat({"messages": longer}).startswith(text.removesuffix("<|assistant|>"))
    # Tools are rendered through the transformers-style tojson (non-ASCII kept), as vLLM dumps them.
    with_tools = tok.render_chat(
        {"messages": messages, "tools": [{"type": "function", "function": {"name": "é"}}]}
    )
    assert '<|tools|> [{"type": "function", "function": {"name": "é", "description": null' in with_tools


def test_template_errors_and_sandbox_violations_are_template_errors(tmp_path, hf_dir):
    tok = HFTokenizer.from_dir(str(hf_dir))
    with pytest.raises(Untokenizable) as e:
        tok.render_chat({"messages": [{"role": "tool", "content": "x"}]})  # raise_exception() in the template
    assert e.value.reason is Reason.TEMPLATE_ERROR
    build_tokenizer_dir(tmp_path / "evil", template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(Untokenizable) as e:
        HFTokenizer.from_dir(str(tmp_path / "evil")).render_chat(
            {"messages": [{"role": "user", "content": "x"}]}
        )
    assert e.value.reason is Reason.TEMPLATE_ERROR


def test_template_list_form_and_missing_template(tmp_path):
    build_tokenizer_dir(
        tmp_path / "named",
        template=[
            {"name": "tool_use", "template": "nope"},
            {"name": "default", "template": "{{ bos_token }}!"},
        ],
    )
    named = HFTokenizer.from_dir(str(tmp_path / "named"))
    assert named.render_chat({"messages": [{"role": "user", "content": "x"}]}) == "<s>!"
    build_tokenizer_dir(tmp_path / "none", template=None)
    tok = HFTokenizer.from_dir(str(tmp_path / "none"))
    assert not tok.has_chat_template
    with pytest.raises(Untokenizable) as e:
        tok.chat_ids({"messages": [{"role": "user", "content": "x"}]})
    assert e.value.reason is Reason.NO_TEMPLATE


def test_tokenizer_json_without_config(tmp_path, hf_dir):
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    tok = HFTokenizer.from_dir(str(tmp_path / "bare"))
    assert len(tok.encode("hello")) == 2 and not tok.has_chat_template


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: None, "is not a directory"),
        (lambda p: p.mkdir(), "no tokenizer.json"),
        (lambda p: (p.mkdir(), (p / "tokenizer.json").write_text("{nope")), "cannot load"),
    ],
)
def test_load_errors_are_one_line(tmp_path, setup, message):
    path = tmp_path / "t"
    setup(path)
    with pytest.raises(TokenizerError, match=message) as e:
        HFTokenizer.from_dir(str(path))
    assert "\n" not in str(e.value)


def test_bad_config_and_template_syntax(tmp_path, hf_dir):
    build_tokenizer_dir(tmp_path / "syntax", template="{% for %}")
    with pytest.raises(TokenizerError, match="invalid chat template"):
        HFTokenizer.from_dir(str(tmp_path / "syntax"))
    (hf_dir / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(TokenizerError, match="not a JSON object"):
        HFTokenizer.from_dir(str(hf_dir))


def test_load_tokenizer_spec(hf_dir):
    assert isinstance(load_tokenizer("bytes"), BytesTokenizer)
    tok = load_tokenizer(str(hf_dir))
    assert isinstance(tok, HFTokenizer) and load_tokenizer(str(hf_dir)) is tok  # cached


def test_bytes_tokenizer_matches_the_fake_engine():
    tok = BytesTokenizer()
    msgs = [{"role": "user", "content": "héllo"}]
    assert tok.encode("héllo") == encode("héllo")
    assert tok.render_chat({"messages": msgs}) == render_chat(msgs)
    assert tok.chat_ids({"messages": msgs}) == encode(render_chat(msgs))


class _Recording:
    """Wraps a tokenizer and records the thread each call ran on."""

    def __init__(self, inner):
        self.inner, self.threads = inner, []

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def call(*a, **kw):
            self.threads.append(threading.current_thread())
            return fn(*a, **kw)

        return call


async def test_large_prompts_are_tokenized_off_the_event_loop(hf_dir):
    from concurrent.futures import ThreadPoolExecutor

    rec = _Recording(HFTokenizer.from_dir(str(hf_dir)))
    chat = {"messages": [{"role": "user", "content": "hello world"}]}
    failing = {"messages": [{"role": "tool", "content": "x"}]}
    with ThreadPoolExecutor(1) as pool:
        tok = AsyncTokenizer(rec, pool, inline_max_bytes=100)
        small = await tok.prompt("hello world", {}, size=50)
        assert rec.threads.pop() is threading.main_thread()
        big = await tok.prompt("hello world", {}, size=101)
        assert rec.threads.pop() is not threading.main_thread()
        assert small == big
        assert await tok.chat_ids(chat, 101) == await tok.chat_ids(chat, 1)
        assert rec.threads[0] is not threading.main_thread() and rec.threads[1] is threading.main_thread()
        assert await tok.chat_text(chat, 101) == await tok.chat_text(chat, 1)
        # A chat the tokenizer cannot render raises Untokenizable (routed without tokens), on the pool too.
        for size in (1, 1000):
            with pytest.raises(Untokenizable):
                await tok.chat_ids(failing, size)
        with pytest.raises(Untokenizable):
            await tok.chat_text(failing, 1)
    bytes_tok = AsyncTokenizer(BytesTokenizer(), None)
    with pytest.raises(Untokenizable):
        await bytes_tok.chat_ids({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 1)


def test_template_choice_follows_the_engines(tmp_path, hf_dir):
    user = {"messages": [{"role": "user", "content": "x"}]}
    tools = {**user, "tools": [{"type": "function", "function": {"name": "f"}}]}
    # Named templates: "tool_use" when tools are sent, else "default".
    build_tokenizer_dir(
        tmp_path / "named",
        template=[
            {"name": "default", "template": "plain"},
            {"name": "tool_use", "template": "{{ tools[0].function.name }}"},
        ],
    )
    named = HFTokenizer.from_dir(str(tmp_path / "named"))
    assert (named.render_chat(user), named.render_chat(tools)) == ("plain", "f")
    # chat_template.jinja beside the tokenizer wins over the config's; {% generation %} blocks load and
    # render as their body.
    (hf_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    )
    assert HFTokenizer.from_dir(str(hf_dir)).render_chat(user) == "[x]"
    # The engines' own --chat-template: a file replaces the directory's, a name picks one of them.
    override = tmp_path / "engine.jinja"
    override.write_text("{{ bos_token }}override")
    assert load_tokenizer(str(hf_dir), Family.VLLM, str(override)).render_chat(user) == "<s>override"
    assert load_tokenizer(str(tmp_path / "named"), Family.VLLM, "default").render_chat(tools) == "plain"
    with pytest.raises(ChatTemplateSpecError, match="neither a file nor a named template"):
        load_tokenizer(str(hf_dir), Family.VLLM, "no-such-template")
    with pytest.raises(ChatTemplateSpecError, match="needs a tokenizer directory"):
        load_tokenizer("bytes", Family.VLLM, str(override))


def _deep(n: int):
    d: dict = {}
    for _ in range(n):
        d = {"a": d}
    return d


@pytest.mark.parametrize("family", list(Family))
async def test_hostile_chat_bodies_are_refused_never_a_crash(hf_dir, family):
    """Input that makes the rules fail (nesting past the stack, a list where a string is due, a lone
    surrogate) is a refusal the router counts, not a 500; a completion prompt that is not valid
    Unicode stays the 400 it was."""
    tok = AsyncTokenizer(load_tokenizer(str(hf_dir), family), None)
    user = {"role": "user", "content": "hello"}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}
    bodies = [
        {"messages": [user, {"role": "assistant", "content": None, "tool_calls": [call]}]},
        {"messages": [{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]},
        {"messages": [user], "reasoning_effort": []},
        {
            "messages": [user],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": _deep(5000)}}],
        },
        {"messages": [{"role": "user", "content": "bad \ud800 text"}]},
    ]
    for body in bodies:
        with pytest.raises(Untokenizable) as e:
            await tok.chat_ids(body, 1)
        assert e.value.reason in (Reason.REJECTED, Reason.TEMPLATE_ERROR), body
    with pytest.raises(UnicodeEncodeError):
        await tok.prompt("bad \ud800 text", {"prompt": "bad \ud800 text"}, 1)
