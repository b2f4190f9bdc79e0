"""What one client's huge prompt costs everyone else: three chat prompts of 3.9 MB each (2.6M
tokens, refused as context_length_exceeded) sent at once, three rounds, while `/health` is polled.
Prints each round's refusal times and the slowest `/health` answer.
usage: python scripts/huge_prompt.py BASE_URL MODEL   (scripts/bench_huge_prompt.sh runs it A/B)"""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx


def main(base: str, model: str) -> None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "ab " * 1_300_000}],
                       "max_tokens": 4}).encode()  # fmt: skip
    for rnd in range(3):
        done: list[tuple[int, float]] = []

        def big() -> None:
            t = time.perf_counter()
            r = httpx.post(f"{base}/v1/chat/completions", content=body, timeout=300,
                           headers={"content-type": "application/json"})  # fmt: skip
            done.append((r.status_code, time.perf_counter() - t))

        senders = [threading.Thread(target=big) for _ in range(3)]
        for s in senders:
            s.start()
        worst, polls = 0.0, 0
        while polls == 0 or any(s.is_alive() for s in senders):  # (at least once, while they are sent)
            t = time.perf_counter()
            httpx.get(f"{base}/health", timeout=300)
            worst, polls = max(worst, time.perf_counter() - t), polls + 1
            time.sleep(0.02)
        for s in senders:
            s.join()
        answers = ", ".join(f"{status} in {secs:.2f}s" for status, secs in sorted(done, key=lambda d: d[1]))
        print(f"round {rnd}: huge prompts answered {answers}; slowest of {polls} /health {worst:.3f}s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
