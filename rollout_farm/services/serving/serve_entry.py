"""Import path for `serve run rollout_farm.services.serving.serve_entry:app` and KubeRay's serveConfigV2 (settings from
FARM_*; the state's Redis must be given as FARM_REDIS_URL: an embedded one would die with the process that builds the
app)."""

from rollout_farm.services.config.settings import ServiceSettings
from rollout_farm.services.serving.app import build_app
from rollout_farm.services.serving.server import with_model_folder

app = build_app(with_model_folder(ServiceSettings()))
