#!/usr/bin/env bash
# Smoke test of deploy/serve.yaml: `serve run` on a fresh local Ray, then /health, /v1/models,
# one completion and one streamed chat through HTTP, then Ctrl-C (SIGINT) and a clean exit.
#
#   scripts/serve_smoke.sh [PORT]      # default port 8000; DSV4RAY_MODEL picks the checkpoint
#
# The port is the only change made to the config (in a temporary copy). Ray's token
# authentication stays on (RAY_AUTH_MODE=token). tests/ray/test_serve_deploy.py runs this.
set -euo pipefail
set -m  # the server gets its own process group, so it receives the SIGINT sent to it below

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PORT=${1:-8000}
SERVE=${SERVE_BIN:-$(command -v serve || echo "$ROOT/.venv/bin/serve")}
URL="http://127.0.0.1:$PORT"
WORK=$(mktemp -d)
export RAY_AUTH_MODE=token
unset RAY_ADDRESS  # always a fresh local Ray: never deploy onto someone's cluster by accident

sed "s/^  port: 8000$/  port: $PORT/" "$ROOT/deploy/serve.yaml" > "$WORK/serve.yaml"
grep -q "port: $PORT" "$WORK/serve.yaml"

cd "$ROOT"
"$SERVE" run "$WORK/serve.yaml" > "$WORK/serve.log" 2>&1 &
PID=$!
stop() {
    kill -INT "$PID" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$PID" 2>/dev/null || break; sleep 1; done
    kill -KILL "$PID" 2>/dev/null || true
    rm -rf "$WORK"
}
trap stop EXIT

fail() { echo "serve smoke: FAILED: $*"; tail -n 40 "$WORK/serve.log"; exit 1; }

for i in $(seq 240); do
    curl -sf "$URL/health" > /dev/null 2>&1 && break
    kill -0 "$PID" 2>/dev/null || fail "serve run exited"
    [ "$i" = 240 ] && fail "no /health after 240 s"
    sleep 1
done

MODEL=$(curl -sf "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])') \
    || fail "GET /v1/models"
echo "serve smoke: serving model $MODEL at $URL"

curl -sf "$URL/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL\", \"prompt\": \"Hello\", \"max_tokens\": 4, \"temperature\": 0}" \
    | python3 -c '
import json, sys
body = json.load(sys.stdin)
assert body["object"] == "text_completion", body
assert body["usage"]["completion_tokens"] >= 1, body
print("serve smoke: completion", body["usage"])' || fail "POST /v1/completions"

curl -sfN "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 4, \"stream\": true}" \
    | python3 -c '
import json, sys
events = [line[6:] for line in sys.stdin.read().splitlines() if line.startswith("data: ")]
assert events[-1] == "[DONE]", events
chunks = [json.loads(e) for e in events[:-1]]
assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length"), chunks[-1]
print("serve smoke: streamed chat,", len(chunks), "chunks")' || fail "streamed POST /v1/chat/completions"

kill -INT "$PID"
for _ in $(seq 60); do kill -0 "$PID" 2>/dev/null || break; sleep 1; done
kill -0 "$PID" 2>/dev/null && fail "serve run did not stop on SIGINT"
echo "serve smoke: OK"
