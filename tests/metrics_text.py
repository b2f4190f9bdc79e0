"""Reading Prometheus' text format (0.0.4) back in tests, independently of ``llmbus.metrics``."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[str, float]:
    """Every sample as ``name{labels}`` -> value; checks the format line by line: each sample's
    family typed before it, no family typed twice, no label twice in a sample, no sample twice."""
    samples: dict[str, float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name = line.split()[2]
            assert name not in typed, f"family {name} typed twice"
            typed.add(name)
            continue
        if line.startswith("# HELP "):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        assert re.sub(r"_(bucket|sum|count)$", "", m.group(1)) in typed or m.group(1) in typed, f"untyped {line!r}"
        key = m.group(1) + (m.group(2) or "")
        names = [n for n, _ in _LABEL.findall(m.group(2) or "")]
        assert len(names) == len(set(names)), f"a label twice (Prometheus refuses the whole scrape): {line!r}"
        assert key not in samples, f"sample {key} twice"
        samples[key] = float(m.group(3))
    return samples


def labels_of(key: str) -> dict[str, str]:
    return dict(_LABEL.findall(key[key.find("{"):])) if "{" in key else {}


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for k, v in samples.items()
               if k.split("{")[0] == name and labels.items() <= labels_of(k).items())  # fmt: skip
