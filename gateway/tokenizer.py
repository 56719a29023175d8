"""The model's tokenizer as the gateway sees it: encode, decode, chat template, eos ids, limits.

`load_tokenizer("tiny")` builds the embedded byte-level tokenizer in code (docs/architecture.md);
`load_tokenizer(DIR)` reads an HF checkpoint: tokenizer.json (via `tokenizers`),
tokenizer_config.json (chat template rendered with jinja2 the way `transformers` does, bos/eos),
generation_config.json (extra eos ids) and config.json (max_position_embeddings, vocab_size).
`load_tokenizer(FILE.gguf)` (or `smollm2-135m-instruct`, or a dir with one .gguf) rebuilds the tokenizer from the
GGUF metadata (gateway/gguf_tokenizer.py) and takes the context length from it as the worker does.
`--tokenizer DIR` swaps in an HF tokenizer dir for any model.
Incremental detokenization and stop strings live in gateway/detokenizer.py.
Must not import zmq, aiohttp or torch.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from gateway import gguf_tokenizer
from laneserve import modelspec

CHATML_TEMPLATE = (  # an assistant turn's tool calls as <tool_call> JSON lines after its text (which may be none)
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '\n<tool_call>' + {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson"
    " + '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template rejected the conversation (raise_exception) or failed to render: a 400."""


@dataclass
class ModelTokenizer:
    """Everything the gateway needs to know about the served model's text side."""

    tokenizer: Tokenizer
    model_id: str
    vocab_size: int  # the model's embedding rows: valid token ids are [0, vocab_size)
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    bos_token: str | None = None
    eos_token: str | None = None
    bos_token_id: int | None = None
    chat_template: str | None = None
    template_vars: dict = field(default_factory=dict)  # other special tokens the template may use
    add_bos_token: bool = False  # prepend bos when tokenizer.json's post-processor does not
    # a request's sampling values where it gives none: an HF model dir's generation_config.json's (--generation-config)
    sampling_defaults: dict = field(default_factory=dict)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): the gateway tokenizes in a thread, and the
        # event loop must keep running meanwhile
        ids = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None \
                and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def prefix_ids(self) -> list[int]:
        """The tokens encode(add_special_tokens=True) puts before a text (BOS, for tokenizers that add one)."""
        cached = self.__dict__.get("_prefix_ids")
        if cached is None:
            with_specials, plain = self.encode("a", True), self.encode("a", False)
            n = len(with_specials) - len(plain)
            cached = with_specials[:n] if n > 0 and with_specials[n:n + len(plain)] == plain else []
            self.__dict__["_prefix_ids"] = cached
        return list(cached)

    def decode_long(self, ids: list[int]) -> str:
        """decode() that releases the GIL (for a whole prompt, in a thread), special tokens kept (as vLLM's
        /detokenize and echo show them)."""
        return self.tokenizer.decode_batch([ids], skip_special_tokens=False)[0]

    def id_to_token(self, token_id: int) -> str:
        return self.tokenizer.id_to_token(token_id) or ""

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    @property
    def special_texts(self) -> tuple[str, ...]:
        """The text of every special token (e.g. "<|im_end|>")."""
        cached = self.__dict__.get("_special_texts")
        if cached is None:
            cached = self.__dict__["_special_texts"] = tuple(
                t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special and t.content)
        return cached

    def has_special_text(self, text: str) -> bool:
        """Whether `text` holds a special token's text (one compiled search)."""
        pattern = self.__dict__.get("_special_re")
        if pattern is None:
            texts = sorted(self.special_texts, key=len, reverse=True)
            pattern = self.__dict__["_special_re"] = re.compile("|".join(map(re.escape, texts))) if texts else None
        return pattern is not None and pattern.search(text) is not None

    def encode_as_text(self, text: str) -> list[int]:
        """`text` tokenized with special-token strings in it as plain text, not control tokens (a copy of the
        tokenizer with encode_special_tokens set: the flag is per tokenizer, and threads share this one)."""
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = Tokenizer.from_str(self.tokenizer.to_str())
            plain.encode_special_tokens = True
            self.__dict__["_plain"] = plain
        return plain.encode_batch([text], add_special_tokens=False)[0].ids

    @property
    def max_prompt_chars(self) -> int:
        """No text longer than this fits the context: max_model_len tokens of the longest piece in the vocabulary
        (a bound checked before tokenizing, so a hostile prompt costs nothing)."""
        cached = self.__dict__.get("_max_chars")
        if cached is None:
            longest = max((len(p) for p in self.tokenizer.get_vocab(with_added_tokens=True)), default=1)
            cached = self.__dict__["_max_chars"] = self.max_model_len * max(longest, 1)
        return cached

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (a piece of a UTF-8 character stays that piece, where decoding it alone gives
        U+FFFD): byte-level BPE pieces mapped back through GPT-2's byte alphabet, SentencePiece byte tokens
        (<0xE2>) as their byte, other pieces with '▁' as a space."""
        cache = self.__dict__.setdefault("_bytes", {})
        out = cache.get(token_id)
        if out is None:
            piece = self.tokenizer.id_to_token(token_id) or ""
            out = None
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    out = bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            if out is None and self._byte_level and token_id not in self._special_ids:
                decode = _byte_decoder()
                if all(c in decode for c in piece):
                    out = bytes(decode[c] for c in piece)
            if out is None:
                out = piece.replace("\u2581", " ").encode()
            cache[token_id] = out
        return out

    @property
    def _byte_level(self) -> bool:
        cached = self.__dict__.get("_is_byte_level")
        if cached is None:
            decoder = json.loads(self.tokenizer.to_str()).get("decoder") or {}
            kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", ())]
            cached = self.__dict__["_is_byte_level"] = "ByteLevel" in kinds
        return cached

    @property
    def _special_ids(self) -> frozenset[int]:
        cached = self.__dict__.get("_specials")
        if cached is None:
            cached = frozenset(i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special)
            self.__dict__["_specials"] = cached
        return cached

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            variables: dict | None = None, **extra) -> str:
        """variables: more of the template's variables, any names (a request's chat_template_kwargs)."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            template = _compile(self.chat_template)
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                   **self.template_vars, **extra, **(variables or {}))
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from None
        except (TypeError, KeyError, AttributeError, ValueError) as exc:
            # HF templates index message fields freely; a malformed message must be a 400, not a 500.
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from None


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character that stands for each byte -> the byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    # Same environment as transformers' _compile_jinja_template, so HF templates render identically.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def build_tiny_tokenizer() -> Tokenizer:
    """Byte-level: token id == byte value for 0..255, then the tiny spec's special tokens from 256 on."""
    byte_char = gguf_tokenizer.bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={byte_char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in modelspec.TINY_SPECIAL_TOKENS])
    return tok


def tiny_tokenizer(model_id: str = "tiny") -> ModelTokenizer:
    tok = build_tiny_tokenizer()
    spec = modelspec.TINY_CONFIG
    bos_id, eos_ids = modelspec.TINY_BOS_ID, modelspec.TINY_EOS_IDS
    return ModelTokenizer(tokenizer=tok, model_id=model_id, vocab_size=spec.vocab_size,
                          max_model_len=spec.max_position_embeddings, eos_token_ids=eos_ids,
                          bos_token=tok.id_to_token(bos_id), eos_token=tok.id_to_token(eos_ids[0]), bos_token_id=bos_id,
                          chat_template=CHATML_TEMPLATE)


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [v for v in value if isinstance(v, int)]


def load_tokenizer(model: str, served_model_name: str = "", max_model_len: int = 0,
                   tokenizer: str = "") -> ModelTokenizer:
    """The tokenizer for `tiny`, an HF checkpoint directory or a GGUF file (its name, path, or a directory holding
    one: laneserve.gguf_file.resolve_model); `tokenizer` (--tokenizer DIR) swaps in an HF tokenizer directory while
    the model still gives the context limit, vocabulary size and eos ids. max_model_len > 0 lowers the model's
    context limit (as the worker does: laneserve.modelspec.resolve_max_model_len)."""
    try:
        if model == "tiny":
            tok = tiny_tokenizer(served_model_name or "tiny")
            if tokenizer:
                tok = _override(tok, tokenizer)
        else:
            from laneserve import gguf_file  # numpy via gguf, still torch-free

            path = gguf_file.resolve_model(model)
            name = served_model_name or _model_id(model, path)
            if tokenizer:
                tok = _override(_model_limits(path, name), tokenizer)
            elif gguf_file.is_gguf(path):
                tok = _load_gguf(path, name)
            else:
                tok = _load_dir(path, name)
        tok.max_model_len = modelspec.resolve_max_model_len(tok.max_model_len, max_model_len)
    except (ValueError, OSError) as exc:  # ModelConfigError, GGUFError, a bad --max-model-len, unreadable files
        raise SystemExit(str(exc)) from None
    return tok


def read_chat_template(value: str) -> str:
    """--chat-template: a file's contents when `value` names a file, else `value` itself (it must look like a Jinja
    template then); a template that does not compile stops the gateway at start."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            value = f.read()
    elif "{" not in value:
        raise SystemExit(f"--chat-template {value!r}: no such file, and not a Jinja template")
    try:
        _compile(value)
    except jinja2.TemplateError as exc:
        raise SystemExit(f"--chat-template: {exc}") from None
    return value


def _model_id(model: str, path: str) -> str:
    from laneserve import gguf_file

    if model == gguf_file.SMOLLM2:
        return model
    if path.endswith(".gguf"):
        return os.path.basename(path)[: -len(".gguf")]
    return os.path.basename(os.path.normpath(path))


SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _sampling_defaults(gcfg: dict) -> dict:
    """The sampling values of a generation_config.json (vLLM's `--generation-config auto` takes the same keys but
    max_new_tokens); the gateway checks them as a request's when it uses them (gateway/app.py)."""
    return {k: gcfg[k] for k in SAMPLING_DEFAULT_KEYS
            if isinstance(gcfg.get(k), (int, float)) and not isinstance(gcfg.get(k), bool)}


def _model_limits(path: str, name: str) -> ModelTokenizer:
    """What the model (not its tokenizer) fixes: vocab_size, max_model_len, eos ids; no tokenizer yet."""
    from laneserve import gguf_file

    if gguf_file.is_gguf(path):
        mc = modelspec.load_model_config(path)
        vocab, max_len, eos, defaults = mc.vocab_size, mc.max_position_embeddings, mc.eos_token_ids, {}
    else:
        mcfg = _read_json(os.path.join(path, "config.json"))
        text_cfg = mcfg.get("text_config", mcfg)
        gcfg = _read_json(os.path.join(path, "generation_config.json"))
        vocab = int(text_cfg.get("vocab_size") or 0)
        max_len = modelspec.max_position_embeddings(text_cfg)
        eos = tuple(dict.fromkeys(_as_ids(gcfg.get("eos_token_id")) + _as_ids(text_cfg.get("eos_token_id"))))
        defaults = _sampling_defaults(gcfg)
    return ModelTokenizer(tokenizer=None, model_id=name, vocab_size=vocab,  # type: ignore[arg-type]
                          max_model_len=max_len, eos_token_ids=tuple(eos),
                          sampling_defaults=defaults)


def _override(model: ModelTokenizer, tokenizer_dir: str) -> ModelTokenizer:
    """--tokenizer DIR: the HF tokenizer in DIR, with the model's limits and its eos ids added to DIR's."""
    if not os.path.isdir(tokenizer_dir):
        raise SystemExit(f"--tokenizer {tokenizer_dir}: not a directory (an HF tokenizer dir with tokenizer.json)")
    tok = _load_dir(tokenizer_dir, model.model_id)
    tok.vocab_size = max(model.vocab_size, tok.tokenizer.get_vocab_size(with_added_tokens=True))
    tok.max_model_len = model.max_model_len
    tok.eos_token_ids = tuple(dict.fromkeys(tok.eos_token_ids + model.eos_token_ids))
    tok.sampling_defaults = model.sampling_defaults
    return tok


# Turn-end tokens a chat template may close a reply with; generation also stops at them when the template uses one
# (llama.cpp treats them as end-of-generation too; HF's eos is the file's eos_token_id).
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def _load_gguf(path: str, name: str) -> ModelTokenizer:

    from laneserve import gguf_file

    md = gguf_file.metadata(path)  # GGUFError naming the file if it can't be read
    mc = modelspec.load_model_config(path)  # the worker's rule: the same context length and vocabulary
    tokenizer = gguf_tokenizer.build(path, md)
    tokens = md["tokenizer.ggml.tokens"]

    def token(key: str) -> tuple[str | None, int | None]:
        i = md.get(f"tokenizer.ggml.{key}")
        return (tokens[i], int(i)) if isinstance(i, int) and 0 <= i < len(tokens) else (None, None)

    bos, bos_id = token("bos_token_id")
    eos, eos_id = token("eos_token_id")
    template = md.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise gguf_tokenizer.GGUFTokenizerError(f"{path}: metadata tokenizer.chat_template is not a string")
    eos_ids = [eos_id] if eos_id is not None else []
    for key in ("eot_token_id", "eom_token_id"):
        if token(key)[1] is not None:
            eos_ids.append(token(key)[1])
    for text in TURN_END_TOKENS:
        i = tokenizer.token_to_id(text)
        if template and text in template and i is not None and i != bos_id:
            eos_ids.append(i)
    extra = {name_: t for name_, key in (("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))
             if (t := token(key)[0]) is not None}
    # transformers: a SentencePiece vocabulary adds bos unless the file says otherwise; byte-level only when it says so
    add_bos = md.get("tokenizer.ggml.add_bos_token", md.get("tokenizer.ggml.model") == "llama")
    return ModelTokenizer(tokenizer=tokenizer, model_id=name,
                          vocab_size=max(mc.vocab_size, tokenizer.get_vocab_size(with_added_tokens=True)),
                          max_model_len=mc.max_position_embeddings, eos_token_ids=tuple(dict.fromkeys(eos_ids)),
                          bos_token=bos, eos_token=eos, bos_token_id=bos_id, chat_template=template,
                          template_vars=extra, add_bos_token=bool(add_bos) and bos_id is not None)


def _load_dir(path: str, served_model_name: str) -> ModelTokenizer:
    tj = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tj):
        raise SystemExit(f"{path}: no tokenizer.json (the gateway reads the fast tokenizer file only)")
    tokenizer = Tokenizer.from_file(tj)
    tcfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    gcfg = _read_json(os.path.join(path, "generation_config.json"))
    mcfg = _read_json(os.path.join(path, "config.json"))
    text_cfg = mcfg.get("text_config", mcfg)
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and os.path.exists(os.path.join(path, "chat_template.jinja")):
        with open(os.path.join(path, "chat_template.jinja"), encoding="utf-8") as f:
            template = f.read()
    bos, eos = _token_text(tcfg.get("bos_token")), _token_text(tcfg.get("eos_token"))
    bos_id = tokenizer.token_to_id(bos) if bos else None
    eos_ids: list[int] = []
    if eos and tokenizer.token_to_id(eos) is not None:
        eos_ids.append(tokenizer.token_to_id(eos))
    for i in _as_ids(gcfg.get("eos_token_id")) + _as_ids(text_cfg.get("eos_token_id")):
        if i not in eos_ids:
            eos_ids.append(i)
    extra = {k: _token_text(v) for k, v in tcfg.items()
             if k.endswith("_token") and k not in ("bos_token", "eos_token") and _token_text(v) is not None}
    vocab = max(int(text_cfg.get("vocab_size") or 0), tokenizer.get_vocab_size(with_added_tokens=True))
    max_len = modelspec.max_position_embeddings(text_cfg)  # the worker's rule, fallback included
    # A Llama-style tokenizer.json usually prepends bos in its post-processor; add_bos_token covers the rest.
    add_bos = bool(tcfg.get("add_bos_token", False)) and bos_id is not None \
        and bos_id not in tokenizer.encode("x", add_special_tokens=True).ids
    return ModelTokenizer(tokenizer=tokenizer, model_id=served_model_name or os.path.basename(os.path.normpath(path)),
                          vocab_size=vocab, max_model_len=max_len, eos_token_ids=tuple(eos_ids), bos_token=bos,
                          eos_token=eos, bos_token_id=bos_id, chat_template=template, template_vars=extra,
                          add_bos_token=add_bos, sampling_defaults=_sampling_defaults(gcfg))
