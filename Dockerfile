# blocklab serve in a container: CPU torch and the versions pinned in requirements.lock, the builtin
# model that ships inside the package (so it starts offline), a non-root user, /health as the health
# check. docs/serving.md ("Containers and replicas") has the compose file and the Kubernetes manifest.
#
#   docker build -t blocklab .
#   docker run --rm -p 8000:8000 -e LIT_SERVER_API_KEY=change-me blocklab
FROM python:3.11-slim

# PyTorch's index of CPU wheels: requirements.lock pins torch's CPU build (2.13.0+cpu), which PyPI lacks.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/blocklab
COPY pyproject.toml requirements.lock README.md ./
COPY lab lab
COPY serve serve
# The package and its runtime dependencies only (not the lock's dev tools), each at the lock's version.
RUN pip install --extra-index-url "$TORCH_INDEX" -c requirements.lock . \
    && useradd --create-home --uid 10001 blocklab

USER 10001
EXPOSE 8000
# SIGTERM drains: requests in flight get --drain-timeout seconds; give the container more than that
# before it is killed (compose's stop_grace_period, Kubernetes' terminationGracePeriodSeconds).
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
# One torch thread per replica: os.cpu_count() in a container is the host's, not the container's
# share, and too many threads spin (docs/serving.md); scale with replicas. tests/test_deploy.py runs
# exactly this command.
CMD ["blocklab", "serve", "--host", "0.0.0.0", "--port", "8000", "--model", "builtin", "--threads", "1", "--drain-timeout", "30"]
