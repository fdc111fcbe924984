"""The Go parsers and Kubernetes name and label formats that KubeRay's validation uses, ported to Python with their
messages: Go's time.ParseDuration, and k8s.io/apimachinery v0.36.0 (the version KubeRay v1.7.0's go.mod pins):
pkg/util/version ParseGeneric and LessThan, pkg/util/validation and pkg/api/validate/content. k8s.io/apimachinery
is Apache-2.0 (tests/deploy/schemas/LICENSE-Apache-2.0.txt)."""

from __future__ import annotations

import re


def go_duration_sign(text: str) -> int | None:
    """The sign (-1, 0, 1) of Go's time.ParseDuration(text), or None when it does not parse."""
    if re.fullmatch(r"[-+]?0", text):
        return 0
    if not re.fullmatch(r"[-+]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:ns|us|µs|μs|ms|s|m|h))+", text):
        return None
    if not re.search(r"[1-9]", text):
        return 0
    return -1 if text.startswith("-") else 1


def generic_version(text: str) -> tuple[int, ...] | str:
    """version.ParseGeneric: two or more dot-separated numbers, an optional "v" and any suffix; or its error."""
    match = re.match(r"\s*v?([0-9]+(?:\.[0-9]+)*)", text)
    if not match:
        return f'could not parse "{text}" as version'
    parts = match.group(1).split(".")
    if len(parts) < 2:
        return f'illegal version string "{text}"'
    if parts[0].startswith("0") and parts[0] != "0":
        return f'illegal zero-prefixed version component "{parts[0]}" in "{text}"'
    return tuple(map(int, parts))


def older(version: tuple[int, ...], minimum: tuple[int, ...]) -> bool:
    """Version.LessThan, missing components counting as 0."""
    width = max(len(version), len(minimum))
    return version + (0,) * (width - len(version)) < minimum + (0,) * (width - len(minimum))


def regex_error(msg: str, fmt: str, *examples: str) -> str:
    """validation.RegexError."""
    shown = " or ".join(f"'{e}', " for e in examples)
    return f"{msg} (e.g. {shown}regex used for validation is '{fmt}')"


DNS1035 = "[a-z]([-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN = DNS1123_LABEL + "(\\." + DNS1123_LABEL + ")*"
LABEL_KEY = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
LABEL_KEY_MSG = (
    "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"
)


def dns1035_label_errors(value: str) -> list[str]:
    """validation.IsDNS1035Label."""
    errs = ["must be no more than 63 characters"] if len(value) > 63 else []
    if not re.fullmatch(DNS1035, value):
        msg = (
            "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
            "character, and end with an alphanumeric character"
        )
        errs.append(regex_error(msg, DNS1035, "my-name", "abc-123"))
    return errs


def label_key_errors(key: str) -> list[str]:
    """validation.IsQualifiedName (content.IsLabelKey): an optional DNS-1123 subdomain prefix, '/', a name."""
    parts = key.split("/")
    if len(parts) > 2:
        shown = regex_error(LABEL_KEY_MSG, LABEL_KEY, "MyName", "my.name", "123-abc")
        return [f"a valid label key {shown} with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"]
    errs, name = [], parts[-1]
    if len(parts) == 2 and not parts[0]:
        errs.append("prefix part must be non-empty")
    elif len(parts) == 2:
        errs += ["prefix part must be no more than 253 characters"] if len(parts[0]) > 253 else []
        if not re.fullmatch(DNS1123_SUBDOMAIN, parts[0]):
            msg = (
                "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and "
                "must start and end with an alphanumeric character"
            )
            errs.append("prefix part " + regex_error(msg, DNS1123_SUBDOMAIN, "example.com"))
    if not name:
        errs.append("name part must be non-empty")
    elif len(name) > 63:
        errs.append("name part must be no more than 63 characters")
    if not re.fullmatch(LABEL_KEY, name):
        errs.append("name part " + regex_error(LABEL_KEY_MSG, LABEL_KEY, "MyName", "my.name", "123-abc"))
    return errs


def label_value_errors(value: str) -> list[str]:
    """validation.IsValidLabelValue (content.IsLabelValue)."""
    errs = ["must be no more than 63 characters"] if len(value) > 63 else []
    if not re.fullmatch(f"({LABEL_KEY})?", value):
        msg = (
            "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must "
            "start and end with an alphanumeric character"
        )
        errs.append(regex_error(msg, f"({LABEL_KEY})?", "MyValue", "my_value", "12345"))
    return errs
