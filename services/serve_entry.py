"""Import path for `serve run services.serve_entry:app` and KubeRay's serveConfigV2 (settings from FARM_*)."""

from services.app import build_app
from services.models import resolve_model
from services.settings import ServiceSettings

_settings = ServiceSettings()
app = build_app(_settings.model_copy(update={"model": str(resolve_model(_settings.model))}))
