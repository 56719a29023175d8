"""`python -m loadtest.quote_qa --url URL`: RAG-style questions whose answers quote a document, against a running
server, one at a time, greedy; prints the answers' tokens, the wall time and, from the server's /metrics, what
speculative decoding drafted and accepted meanwhile (docs/speculative.md: run the server with and without
`--speculative ngram` and compare). The default document is the first chapter of Pride and Prejudice
(tests/data, public domain)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import aiohttp

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
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        key = name.partition("{")[0].removeprefix("laneserve:").removesuffix("_total")
        if key in SPEC_METRICS:
            out[key] = float(value)
    return out


async def run(url: str, model: str, document: str, max_tokens: int) -> dict:
    async with aiohttp.ClientSession() as http:
        before = await _metrics(http, url)
        answers, tokens = [], 0
        t0 = time.perf_counter()
        for q in QUESTIONS:
            body = {"model": model, "temperature": 0, "max_tokens": max_tokens,
                    "messages": [{"role": "system", "content": "Answer from the document. Quote it exactly."},
                                 {"role": "user", "content": f"Document:\n{document}\n\nQuestion: {q}"}]}
            async with http.post(f"{url}/v1/chat/completions", json=body) as r:
                out = await r.json()
                if r.status != 200:
                    raise SystemExit(f"{r.status}: {out}")
            answers.append(out["choices"][0]["message"]["content"])
            tokens += out["usage"]["completion_tokens"]
        wall = time.perf_counter() - t0
        after = await _metrics(http, url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_METRICS}
    drafted, drafts = delta["spec_decode_num_draft_tokens"], delta["spec_decode_num_drafts"]
    accepted = delta["spec_decode_num_accepted_tokens"]
    return {"wall_s": round(wall, 2), "completion_tokens": tokens, **delta,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": accepted / drafts if drafts else None, "answers": answers}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--document", default=str(DOCUMENT))
    ap.add_argument("--max-tokens", type=int, default=80)
    args = ap.parse_args(argv)
    result = asyncio.run(run(args.url.rstrip("/"), args.model, Path(args.document).read_text(), args.max_tokens))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
