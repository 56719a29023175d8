"""The tokenizer a GGUF file describes, rebuilt as a `tokenizers.Tokenizer` from its metadata.

A GGUF has no tokenizer.json: it stores the vocabulary (tokenizer.ggml.tokens), merges, token
types and scores under llama.cpp's key names. `build` turns them into the same tokenizer that
`transformers` builds for `AutoTokenizer.from_pretrained(dir, gguf_file=...)` (its
integrations/gguf/gguf_tokenizer_mapping.py), so ids, decoding and chat templates match:

* tokenizer.ggml.model "gpt2" (SmolLM2, Qwen2, Llama-3): byte-level BPE; the split regex comes from
  tokenizer.ggml.pre (GPT-2's own when the table below does not name it, as for "smollm").
* tokenizer.ggml.model "llama" (SentencePiece: Llama-2, Mistral): BPE with byte fallback, a Metaspace
  pre-tokenizer, merges from the file or rebuilt from the scores.

Token type 3 (CONTROL) becomes a special added token, 4 (USER_DEFINED) a plain added token.
Torch-free; reads metadata through laneserve.gguf_file.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4
SUPPORTED = ("gpt2", "llama")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex before byte-level BPE (transformers' GGUF_PRE_TOKENIZER_SPLITS)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


class GGUFTokenizerError(ValueError):
    """The file's tokenizer cannot be rebuilt; the message names the file (one line)."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable char map, which tokenizers' ByteLevel pre-tokenizer applies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _merges(md: dict, tokens: list[str], scores: dict[str, float] | None) -> list[tuple[str, str]]:
    if md.get("tokenizer.ggml.merges"):
        return [tuple(m.split(" ", 1)) if isinstance(m, str) else m for m in md["tokenizer.ggml.merges"]]
    if scores is None:
        return []
    # transformers' generate_merges: every split of a token into two vocabulary tokens, best score first
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for merge, score in scores.items():
        local = [(merge[:i], merge[i:], score) for i in range(1, len(merge))
                 if merge[:i] in vocab and merge[i:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _checked(merges: list, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The merges, each two vocabulary tokens whose join is one too; else ValueError (the tokenizers library panics
    past Python's exceptions on some such merges)."""
    for m in merges:
        if not (isinstance(m, tuple) and len(m) == 2 and all(isinstance(p, str) and p in vocab for p in m)
                and m[0] + m[1] in vocab):
            raise ValueError(f"tokenizer.ggml.merges holds {' '.join(map(str, m)) if isinstance(m, tuple) else m!r:.60}"
                             ", not two vocabulary tokens that join into one")
    return merges


def _byte_level(md: dict, tokens: list[str]) -> tuple[Tokenizer, set[str]]:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_checked(_merges(md, tokens, None), vocab), dropout=None,
                               continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(md.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, alphabet


def _sentencepiece(md: dict, tokens: list[str]) -> Tokenizer:
    scores = md.get("tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges(md, tokens, dict(zip(tokens, scores)) if scores else None)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_checked(merges, vocab), fuse_unk=True, byte_fallback=True,
                               dropout=None))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    return tok


def build(path: str, md: dict) -> Tokenizer:
    """The `tokenizers.Tokenizer` of GGUF file `path` (metadata `md`), or GGUFTokenizerError naming the file."""
    kind = md.get("tokenizer.ggml.model")
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFTokenizerError(f"{path}: metadata has no tokenizer.ggml.tokens; pass --tokenizer DIR")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise GGUFTokenizerError(f"{path}: metadata tokenizer.ggml.tokens is not a list of strings")
    if kind not in ("gpt2", "llama"):
        raise GGUFTokenizerError(f"{path}: tokenizer model {kind!r} is not supported (supported: "
                                 f"{', '.join(SUPPORTED)}); pass --tokenizer DIR with an HF tokenizer")
    try:
        tok, alphabet = _byte_level(md, tokens) if kind == "gpt2" else (_sentencepiece(md, tokens), None)
    except Exception as e:  # noqa: BLE001 - the tokenizers library's own errors on bad vocabularies
        raise GGUFTokenizerError(f"{path}: {e}") from None
    types = md.get("tokenizer.ggml.token_type") or ()
    # A byte-level vocabulary spells every real token in the byte alphabet; a CONTROL token outside it is a
    # llama.cpp mislabel that transformers skips too. The UNKNOWN one (SentencePiece's <unk>) is special in
    # transformers as well: its text encodes to it, and decoding skips it.
    control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
               if ty in (CONTROL, UNKNOWN) and (alphabet is None or set(t) <= alphabet)]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
            if ty == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)
    return tok
