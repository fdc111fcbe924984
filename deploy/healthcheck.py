"""The images' health check, in Python so the image needs no curl or wget: exit 0 when HEALTHCHECK_URL (default:
the service's /healthz) answers 2xx within HEALTHCHECK_TIMEOUT_S, else 1 with the reason on stderr."""

import os
import sys
import urllib.request

url = os.environ.get("HEALTHCHECK_URL") or f"http://127.0.0.1:{os.environ.get('FARM_PORT', '8000')}/healthz"
try:
    with urllib.request.urlopen(url, timeout=float(os.environ.get("HEALTHCHECK_TIMEOUT_S", "20"))) as answer:
        sys.exit(0 if 200 <= answer.status < 300 else 1)
except Exception as e:  # refused, timed out, or an HTTP error status
    sys.exit(f"unhealthy: {url}: {e}")
