#!/usr/bin/env python3
"""What settling costs the broker: RabbitMQ's CPU per message for publishing (confirmed) and
for consuming with one ack per delivery, with one `multiple` ack per 32, or without acks, on
a quorum and a classic queue. Reads the broker's CPU from /proc (beam.smp), so run it on the
broker's machine, quiet. Uses the py-amqp client of the peer kit's virtualenv:

    ../shared/peers/setup.sh
    /tmp/sb-peers/venv/bin/python scripts/amqp_ack_cost.py [messages]

Why it exists: the bus coalesces acks (common/src/bus/amqp/settle.rs) on this measurement.
"""

import os
import subprocess
import sys
import time

import amqp  # from the peer kit's virtualenv (celery depends on it)

URL = os.environ.get("AMQP_HOST", "127.0.0.1:5672")
BODY = b"x" * 400


def broker_cpu_seconds() -> float:
    pid = subprocess.run(["pgrep", "-o", "beam.smp"], capture_output=True, text=True).stdout.split()[0]
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(queue_type: str, settle: str, n: int) -> tuple[float, float]:
    conn = amqp.Connection(URL)
    conn.connect()
    ch = conn.channel()
    queue = f"sb-ack-cost-{queue_type}-{settle}-{os.getpid()}"
    durable = queue_type == "quorum"
    ch.queue_declare(queue, durable=durable, auto_delete=False, arguments={"x-queue-type": queue_type})
    ch.confirm_select()
    start = broker_cpu_seconds()
    for _ in range(n):
        ch.basic_publish(amqp.Message(BODY, delivery_mode=2 if durable else 1), exchange="", routing_key=queue)
    published = broker_cpu_seconds() - start

    consumer = conn.channel()
    consumer.basic_qos(0, 256, False)
    got = 0

    def on_message(message):
        nonlocal got
        got += 1
        if settle == "single":
            consumer.basic_ack(message.delivery_tag)
        elif settle == "multiple" and (got % 32 == 0 or got == n):
            consumer.basic_ack(message.delivery_tag, multiple=True)

    start = broker_cpu_seconds()
    tag = consumer.basic_consume(queue, callback=on_message, no_ack=settle == "none")
    while got < n:
        conn.drain_events(timeout=10)
    time.sleep(0.5)  # the broker's work on the last acks
    consumed = broker_cpu_seconds() - start
    consumer.basic_cancel(tag)
    ch.queue_delete(queue)
    conn.close()
    return published / n * 1e6, consumed / n * 1e6


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    for queue_type, settle in [
        ("quorum", "single"),
        ("quorum", "multiple"),
        ("classic", "single"),
        ("classic", "multiple"),
        ("classic", "none"),
    ]:
        published, consumed = measure(queue_type, settle, n)
        print(f"{queue_type:8s} acks={settle:9s} publish+confirm {published:5.0f} µs/msg  consume {consumed:5.0f} µs/msg")


if __name__ == "__main__":
    main()
