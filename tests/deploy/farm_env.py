"""Every FARM_* variable a deploy file sets must be a service setting, or one of the few read elsewhere."""

from rollout_farm.services.config.settings import ServiceSettings

READ_ELSEWHERE = {
    "FARM_CACHE": "rollout_farm/services/models.py: where the embedded model is built",
    "FARM_URL": "rollout_farm/trainer/cli.py: the service the `farm rollout|weights|...` commands call",
}


def assert_known_farm_vars(names: set[str], where: str) -> None:
    settings = {f"FARM_{field.upper()}" for field in ServiceSettings.model_fields}
    unknown = {n for n in names if n.startswith("FARM_")} - settings - set(READ_ELSEWHERE)
    assert not unknown, (
        f"{where} sets {sorted(unknown)}, which no setting reads (rollout_farm/services/config/settings.py)"
    )
