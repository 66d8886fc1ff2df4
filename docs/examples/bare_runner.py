"""A complete Switchboard runner without any SDK (AgentRunner Protocol v1, docs/RUNNERS.md).

One JSON object per line on stdin (from the host) and stdout (to the host). Every run asks
the host for its version (a Host API call), then streams its input back word by word.
"""
import itertools, json, queue, sys, threading

lock, pending, cancelled, ids = threading.Lock(), {}, set(), itertools.count(1)


def send(msg):  # one whole line per message, never interleaved between threads
    with lock:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()


def api(run_id, action, params):  # blocks until the reader routes the answer by its id
    call_id = str(next(ids))
    pending[call_id] = answer = queue.Queue()
    send({"op": "api", "id": call_id, "run_id": run_id, "action": action, "params": params})
    reply = answer.get(timeout=30)
    if not reply["ok"]:
        raise RuntimeError(f"{reply['error']['code']}: {reply['error']['message']}")
    return reply["data"]


def run(run_id, context):
    seq = itertools.count(1)

    def result(type_, data):
        send({"op": "result", "run_id": run_id, "result": {"type": type_, "data": data, "sequence": next(seq)}})

    try:
        version = api(run_id, "get_host_version", {})["version"]
        text = context["input"].get("text") or ""
        for i, word in enumerate(text.split()):
            if run_id in cancelled:
                return result("run.failed", {"code": "cancelled", "error": "cancelled by the host"})
            result("message.delta", {"chunk": {"role": "assistant", "content": (" " if i else "") + word}})
        result("message.completed", {"message": {"role": "assistant", "content": f"{text} (host {version})"}})
        result("run.completed", {"finish_reason": "stop"})
    except Exception as e:
        result("run.failed", {"code": "runner.error", "error": str(e), "retryable": False})
    finally:
        send({"op": "done", "run_id": run_id})


for line in sys.stdin:  # the reader: demultiplex the host's lines by op, run id and call id
    msg = json.loads(line) if line.strip() else {}
    if msg.get("op") == "run":
        threading.Thread(target=run, args=(msg["run_id"], msg["context"]), daemon=True).start()
    elif msg.get("op") == "cancel":
        cancelled.add(msg["run_id"])
    elif msg.get("op") == "api_result" and msg["id"] in pending:
        pending.pop(msg["id"]).put(msg)
    elif msg.get("op") == "shutdown":  # sent when no run is in flight; then stdin closes
        break
