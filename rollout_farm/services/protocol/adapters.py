"""LoRA adapters as policies: pushes, their immutable versions, the reference a request names, and the policy every
sample carries (docs/tenants.md)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout_farm.services.protocol.common import Float, Int64, RequestModel, Text

ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
NAME_AT_VERSION = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]{0,63})(@v(?P<version>[0-9]{1,18}))?$")


class AdapterRef(RequestModel):
    """Which policy a request samples from: an adapter by name, at an exact version or the newest from a floor."""

    # the validator's rule, for the schema: not both version and min_version
    model_config = ConfigDict(extra="forbid", json_schema_extra={"not": {"required": ["version", "min_version"]}})

    name: str = Field(..., pattern=ADAPTER_NAME, description="The adapter's name (letters, digits, '.', '_', '-').")
    version: Int64 | None = Field(
        None, ge=1, description="This exact version; 409 naming the oldest resident one when it is no longer resident."
    )
    min_version: Int64 | None = Field(
        None, ge=1, description="The newest resident version, if it is at least this one (409 otherwise)."
    )

    @model_validator(mode="after")
    def _one_of(self) -> AdapterRef:
        if self.version is not None and self.min_version is not None:
            raise ValueError("give version (exact) or min_version (a floor), not both")
        return self

    @classmethod
    def parse(cls, text: str) -> AdapterRef | None:
        """`name` or `name@vN` (the OpenAI routes' `model`); None when `text` is neither."""
        m = NAME_AT_VERSION.match(text)
        if m is None:
            return None
        return cls(name=m["name"], version=int(m["version"]) if m["version"] else None)

    def key(self) -> str:
        """`name@vN` of an exact reference."""
        return f"{self.name}@v{self.version}"


class Policy(BaseModel):
    """The policy that drew a sample: the base weights' version and, for an adapter, its name and version; the digest
    proves which bytes (rollout_farm/services/adapters/digest.py): a client computes the same from what it pushed."""

    model_config = ConfigDict(extra="forbid")

    base_version: int = Field(..., description="The base model's weight version.")
    adapter: str | None = Field(None, description="The adapter's name; null: the base model alone.")
    adapter_version: int | None = Field(None, description="The adapter's version.")
    digest: str | None = Field(
        None, description="'<hash>:<hex>' of the served tensors' checksums; null where the engine cannot hash them."
    )


class AdapterFromPath(RequestModel):
    """POST /v1/adapters/{name}/path: a peft adapter folder every replica can read."""

    path: Text = Field(..., min_length=1, description="Folder with adapter_config.json and adapter_model.safetensors.")
    version: Int64 = Field(..., ge=1, description="The new version of the adapter; never reused for other bytes.")
    probe: dict | None = Field(
        None,
        description="Token sequences and the logprobs the pusher computed for them with this adapter: every replica "
        "scores them before the commit ({sequences, logprobs, tolerance}; docs/tenants.md).",
    )


class AdapterVersion(BaseModel):
    version: int = Field(..., description="The version.")
    digest: str = Field(..., description="Its policy digest (on the base it was pushed on).")
    base_version: int = Field(..., description="The base weight version it was pushed on.")
    sha256: str = Field(..., description="SHA-256 of the adapter's safetensors bytes as pushed.")
    bytes: int = Field(..., description="Size of its tensors.")
    r: int = Field(..., description="Its LoRA rank.")
    state: str = Field(..., description="'resident' (in the resident window) or 'evicted' (samples refused).")
    pushed_at: float = Field(..., description="Unix time of its commit.")


class AdapterInfo(BaseModel):
    name: str = Field(..., description="The adapter's name.")
    owner: str | None = Field(None, description="The tenant that owns it; null: the admin.")
    versions: list[AdapterVersion] = Field(..., description="Every version pushed, oldest first.")
    resident: dict[str, list[int]] = Field(
        default_factory=dict, description="Per engine replica, the versions loaded on it now (GET of one adapter)."
    )


class AdapterList(BaseModel):
    adapters: list[AdapterInfo] = Field(..., description="The adapters the caller may see.")


class AdapterPushResponse(BaseModel):
    name: str = Field(..., description="The adapter.")
    version: int = Field(..., description="The version every replica serves now.")
    digest: str = Field(..., description="Its policy digest, as every replica computed it from the bytes it loaded.")
    tensors: int = Field(..., description="Tensors loaded.")
    bytes: int = Field(..., description="Size of the upload.")
    seconds: float = Field(..., description="Time from upload received to every replica serving it.")
    evicted: list[int] = Field(default_factory=list, description="Versions that left the resident window.")
    again: bool = Field(False, description="The same bytes were pushed as this version before: nothing changed.")


class TenantToken(BaseModel):
    tenant: str = Field(..., description="The tenant's id.")
    token: str = Field(..., description="Its new bearer token: shown this once, only its SHA-256 is kept.")
    tokens: int = Field(..., description="How many tokens the tenant has now.")


class TenantQuota(RequestModel):
    """PUT /v1/tenants/{tenant}/quota: what the tenant may use at once; an unset limit is no limit."""

    model_config = ConfigDict(extra="forbid")

    in_flight_samples: Int64 | None = Field(
        None, gt=0, description="Samples generating at once for the tenant, at most (a request needing more waits)."
    )
    tokens_per_s: Int64 | None = Field(None, gt=0, description="Generated tokens per second, at most (on average).")
    weight: Float = Field(
        1.0, gt=0, le=1000, description="Its share of a busy farm against the other tenants' (FARM_FAIR_SHARE_SAMPLES)."
    )


class TenantInfo(BaseModel):
    tenant: str = Field(..., description="The tenant's id.")
    created: float = Field(..., description="Unix time it was created.")
    tokens: int = Field(..., description="How many tokens it has.")
    quota: TenantQuota = Field(default_factory=TenantQuota, description="Its limits and weight.")


class TenantList(BaseModel):
    tenants: list[TenantInfo] = Field(..., description="Every tenant.")
