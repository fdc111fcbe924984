"""docs/settings.md is what rollout_farm/services/config/settings_doc.py writes from the settings model, and names every
FARM_* variable the code reads."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, SecretStr

from rollout_farm.services.config.settings import ServiceSettings
from rollout_farm.services.config.settings_doc import COMMAND, READ_ELSEWHERE, main, render

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "settings.md"


def test_docs_settings_md_is_current():
    assert DOC.read_text(encoding="utf-8") == render(), f"docs/settings.md is stale: run `{COMMAND}`"


def test_a_changed_description_or_an_added_field_makes_the_doc_stale():
    """The negative control: the comparison above sees each kind of change to the model."""

    class Described(ServiceSettings):
        port: int = Field(8000, ge=1, le=65535, description="Port the HTTP proxy listens on.")

    class Added(ServiceSettings):
        new_knob: int = Field(3, ge=0, description="A setting not in the doc yet.")

    current = DOC.read_text(encoding="utf-8")
    assert render(Described) != current and "listens on" in render(Described)
    assert render(Added) != current and "| `FARM_NEW_KNOB` | int | `3` | >= 0 | A setting not in the doc yet. |" in (
        render(Added)
    )


def test_the_first_line_says_how_to_regenerate_it_and_a_secret_shows_no_default():
    assert COMMAND in render().splitlines()[0]

    class WithDefault(ServiceSettings):
        api_token: SecretStr = Field(SecretStr("hunter2-hunter2"), min_length=8, description="The token.")

    assert "hunter2" not in render(WithDefault)
    assert "| `FARM_API_TOKEN` | str (secret) | (secret) | 8+ characters | The token. |" in render(WithDefault)


def test_the_command_prints_the_doc(capsys):
    main()
    assert capsys.readouterr().out == render()


def farm_vars_unknown(text: str) -> set[str]:
    """FARM_* names in `text` that are neither a setting nor listed as read elsewhere. A name that a known one
    starts with is a docstring's line break (`FARM_ENGINE_BATCH_` then `WINDOW_S`), not a variable."""
    known = {f"FARM_{name.upper()}" for name in ServiceSettings.model_fields} | set(READ_ELSEWHERE)
    found = set(re.findall(r"FARM_[A-Z0-9_]*[A-Z0-9]", text))
    return {n for n in found if not any(k.startswith(n) for k in known)}


def test_every_farm_variable_the_code_reads_is_in_the_doc():
    code = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "rollout_farm").rglob("*.py")))
    unknown = farm_vars_unknown(code)
    assert not unknown, (
        f"{sorted(unknown)}: add each to ServiceSettings or to READ_ELSEWHERE in "
        f"rollout_farm/services/config/settings_doc.py, then run `{COMMAND}`"
    )
    assert farm_vars_unknown('os.environ.get("FARM_NEW_THING")') == {"FARM_NEW_THING"}  # the check sees a new one
