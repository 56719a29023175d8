"""`python -m loadtest.quote_qa --url URL`: RAG-style questions whose answers quote a document, against a running
server, one at a time, greedy; prints the answers' tokens, the wall time and, from the server's /metrics, what
speculative decoding drafted and accepted meanwhile (docs/speculative.md: run the server with and without
`--speculative ngram` and compare). The default document is the first chapter of Pride and Prejudice
(tests/data, public domain)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

from loadtest.cli import check_url, count, positive
from loadtest.client import LoadConfig, _json, probe

DOCUMENT = Path(__file__).resolve().parents[1] / "tests" / "data" / "pride_and_prejudice_ch1.txt"
QUESTIONS = (
    "What did Mrs. Long tell Mrs. Bennet about the man who took Netherfield? Quote the passage.",
    "Quote the first sentence of the text exactly.",
    "What is the name of the young man, and is he married or single? Answer with the exact words from the text.",
    "Copy the sentence in which Mrs. Bennet first speaks to her husband.",
    "How much money does the single man have a year? Quote the text.",
    "Repeat word for word what Mr. Bennet says when his wife asks if he wants to know who has taken Netherfield.",
)
SPEC_METRICS = ("engine_steps", "spec_decode_num_steps", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                "spec_decode_num_accepted_tokens")


async def _metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The speculative-decoding counters of /metrics ({} when the server has none)."""
    async with http.get(f"{url}/metrics") as r:
        text = await r.text(errors="replace") if r.status == 200 else ""
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        key = name.partition("{")[0].removeprefix("laneserve:").removesuffix("_total")
        if key in SPEC_METRICS:
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


async def run(url: str, model: str | None, document: str, max_tokens: int, timeout: float) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        model = (await probe(http, LoadConfig(url=url, model=model, request_timeout=timeout))).model
        before = await _metrics(http, url)
        answers, tokens = [], 0
        t0 = time.perf_counter()
        for q in QUESTIONS:
            body = {"model": model, "temperature": 0, "max_tokens": max_tokens,
                    "messages": [{"role": "system", "content": "Answer from the document. Quote it exactly."},
                                 {"role": "user", "content": f"Document:\n{document}\n\nQuestion: {q}"}]}
            out = await _json(http, "POST", f"{url}/v1/chat/completions", json=body)
            try:
                answers.append(out["choices"][0]["message"]["content"])
                tokens += int(out["usage"]["completion_tokens"])
            except (KeyError, IndexError, TypeError, ValueError):
                raise RuntimeError(f"POST {url}/v1/chat/completions: not an OpenAI chat completion") from None
        wall = time.perf_counter() - t0
        after = await _metrics(http, url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_METRICS}
    drafted, drafts = delta["spec_decode_num_draft_tokens"], delta["spec_decode_num_drafts"]
    accepted = delta["spec_decode_num_accepted_tokens"]
    return {"model": model, "wall_s": round(wall, 2), "completion_tokens": tokens, **delta,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": accepted / drafts if drafts else None, "answers": answers}


def _document(path: str) -> str:
    """argparse type: the text of a UTF-8 file, not empty."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{path} is empty")
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.quote_qa", description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the first model of GET /v1/models")
    ap.add_argument("--document", type=_document, default=str(DOCUMENT), help="a UTF-8 text file")
    ap.add_argument("--max-tokens", type=count, default=80)
    ap.add_argument("--timeout", type=positive, default=300.0, help="seconds for each request")
    args = ap.parse_args(argv)
    try:
        url = check_url(args.url).rstrip("/")
        result = asyncio.run(run(url, args.model, args.document, args.max_tokens, args.timeout))
    except asyncio.TimeoutError:
        print(f"{ap.prog}: error: no response from {args.url} within {args.timeout:g} s", file=sys.stderr)
        return 2
    except (aiohttp.ClientError, OSError, RuntimeError, ValueError) as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
