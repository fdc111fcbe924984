"""Import path for `serve run rollout_farm.services.serve_entry:app` and KubeRay's serveConfigV2 (settings from FARM_*;
the state's Redis must be given as FARM_REDIS_URL: an embedded one would die with the process that builds the app)."""

from rollout_farm.services.app import build_app
from rollout_farm.services.server import with_model_folder
from rollout_farm.services.settings import ServiceSettings

app = build_app(with_model_folder(ServiceSettings()))
