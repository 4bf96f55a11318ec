"""serve.transport: a worker's two pipes, both ends in this process (the worker's used as a worker
process uses them): messages in order both ways, the end of a pipe as the worker's death, a torn
last message dropped, the end of the orders as None."""

import asyncio
import os
import queue

import pytest

from serve.transport import HEADER, Link, frame


def test_orders_and_messages_arrive_whole_and_in_order_and_the_end_follows_them():
    async def scenario() -> None:
        link = Link()
        ends = link.worker_ends
        received, ended = [], asyncio.Event()
        await link.connect(received.append, ended.set)
        with pytest.raises(queue.Empty):
            ends.get_nowait()
        big = {"prompt_tokens": list(range(50_000))}  # larger than a pipe's buffer: sent in pieces
        for order in ("first", big, "last"):
            link.send(order)
        await asyncio.sleep(0)  # the transport writes what the pipe takes; get reads the rest as it comes
        assert await asyncio.to_thread(ends.get) == "first"
        assert await asyncio.to_thread(ends.get) == big
        assert await asyncio.to_thread(ends.get_nowait) == "last"
        for index in range(3):
            ends.put(("event", index, {"event": "token"}))
        torn = frame(("event", 3, {"event": "done"}))
        os.write(ends.events.fileno(), torn[: HEADER.size + 5])  # killed in the middle of a message
        ends.close()  # the worker's death: its ends close with it
        await asyncio.wait_for(ended.wait(), 10)
        assert received == [("event", index, {"event": "token"}) for index in range(3)]
        link.close()

    asyncio.run(scenario())


def test_the_worker_reads_none_once_the_http_side_closes_its_end():
    async def scenario() -> None:
        link = Link()
        await link.connect(lambda message: None, lambda: None)
        link.send("only")
        await asyncio.sleep(0)
        link.close()
        await asyncio.sleep(0)  # the transport closes at the loop's next turn
        assert link.worker_ends.get() == "only"
        assert link.worker_ends.get() is None
        link.worker_ends.close()

    asyncio.run(scenario())
