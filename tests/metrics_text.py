"""Reading Prometheus samples out of a /metrics text, with prometheus_client's parser: the one reader the tests use."""

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> str:
    """The text of GET <url>/metrics."""
    return httpx.get(f"{url}/metrics", timeout=30).text


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of each sample called `name` as exported (a counter's with _total, a histogram's _bucket), in
    the text's order."""
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    """The value of each sample called `name`, by the value of its label `label` (e.g. replica id -> value)."""
    return {labels[label]: value for labels, value in samples(text, name)}


def value(text: str, name: str, **labels: str) -> float:
    """The value of the sample called `name` with exactly these labels; fails if there is none."""
    found = [v for have, v in samples(text, name) if have == labels]
    assert found, f"{name}{labels or ''} not exported"
    return found[0]
