#!/usr/bin/env bash
# Local Apache Kafka (KRaft) on 127.0.0.1 for development and tests.
#   scripts/kafka.sh start|stop|status [--nodes 1|3] [--port 9092] [--dir ~/.cache/lockgate/kafka] [--fresh]
# Same as `lockgate kafka ...` (devtools/kafka_local.py), usable before the package is installed.
# Jars are fetched once with Maven from scripts/kafka/pom.xml; needs java 17+ and mvn.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
cd "$root"
exec "$python" -m lockgate.cli kafka "$@"
