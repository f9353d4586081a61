"""The waiter hub's subscriptions (`shared.waiters`): the channels asked for in one turn of the event loop go in one
SUBSCRIBE; a channel nobody waits on any more stays subscribed a moment and leaves with the others of its time in
one UNSUBSCRIBE; a waiter for it meanwhile finds it live and hears its events. Against the real Redis (or cluster)
of the run."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

import shared.waiters
from shared.redis_io import make_redis
from shared.waiters import UNSUBSCRIBE_AFTER_S, WaiterHub

pytestmark = pytest.mark.redis


@pytest.fixture
async def hub(redis_url, prefix):
    client = make_redis(redis_url)
    hub = WaiterHub(client, f"{prefix}:hub")
    await hub.start()
    yield hub, client
    await hub.close()
    await client.aclose()


class Sent(dict):
    """The channels of each SUBSCRIBE and UNSUBSCRIBE the hub sends; `unsubscribed` is set at each UNSUBSCRIBE."""

    def __init__(self) -> None:
        super().__init__(subscribe=[], unsubscribe=[])
        self.unsubscribed = asyncio.Event()

    async def next_unsubscribe(self, timeout: float) -> None:
        await asyncio.wait_for(self.unsubscribed.wait(), timeout)
        self.unsubscribed.clear()


async def spy(hub: WaiterHub) -> Sent:
    """What the hub sends from now on."""
    await asyncio.wait_for(hub._connected.wait(), 5)
    sent = Sent()
    pubsub = hub._pubsub
    for name in ("subscribe", "unsubscribe"):
        real = getattr(pubsub, name)

        async def recording(*channels, _real=real, _name=name):
            sent[_name].append(list(channels))
            if _name == "unsubscribe":
                sent.unsubscribed.set()
            return await _real(*channels)

        setattr(pubsub, name, recording)
    return sent


async def hears(sub, client, channel: str) -> bool:
    await client.publish(channel, b"state")
    return await sub.wait(2.0)


async def test_channels_asked_for_together_are_subscribed_in_one_command(hub, prefix):
    hub, client = hub
    sent = await spy(hub)
    channels = [f"{prefix}:done{i}" for i in range(5)]
    entered = asyncio.Event()
    release = asyncio.Event()
    heard: list[bool] = []

    async def wait_on(channel: str) -> None:
        async with hub.subscribe(channel) as sub:
            if hub.waiting == len(channels):
                entered.set()
            await release.wait()
            heard.append(await hears(sub, client, channel))

    tasks = [asyncio.create_task(wait_on(c)) for c in channels]
    await asyncio.wait_for(entered.wait(), 5)
    assert sent["subscribe"] == [channels]
    release.set()
    await asyncio.gather(*tasks)
    assert heard == [True] * 5


async def test_a_channel_left_idle_stays_live_for_the_next_waiter_then_leaves_with_the_others(hub, prefix):
    hub, client = hub
    sent = await spy(hub)
    a, b, c = (f"{prefix}:idle{i}" for i in range(3))
    for channel in (a, b, c):
        async with hub.subscribe(channel):
            pass
    assert dict(sent) == {"subscribe": [[a], [b], [c]], "unsubscribe": []}
    async with hub.subscribe(b) as sub:  # still subscribed at Redis: no command, and it hears its events
        assert await hears(sub, client, b)
    assert sent["subscribe"] == [[a], [b], [c]]
    await sent.next_unsubscribe(UNSUBSCRIBE_AFTER_S * 4)
    assert [sorted(u) for u in sent["unsubscribe"]] == [sorted([a, b, c])]
    async with hub.subscribe(a) as sub:  # gone from Redis: subscribed again, and it hears its events
        assert sent["subscribe"][-1] == [a]
        assert await hears(sub, client, a)


async def test_many_idle_channels_leave_at_once(hub, prefix, monkeypatch):
    hub, _ = hub
    monkeypatch.setattr(shared.waiters, "UNSUBSCRIBE_BATCH", 3)
    sent = await spy(hub)
    channels = [f"{prefix}:many{i}" for i in range(3)]
    for channel in channels:
        async with hub.subscribe(channel):
            pass
    await sent.next_unsubscribe(UNSUBSCRIBE_AFTER_S / 5)  # well before the timer would send it
    assert sent["unsubscribe"] == [channels]


@pytest.mark.parametrize("turns", [0, 1, 2, 5])
async def test_a_waiter_that_leaves_before_its_confirmation_leaves_nothing_subscribed(hub, prefix, turns):
    """Cancelled at any point of its subscription (before its SUBSCRIBE is sent, before it is confirmed, or after):
    the channel is not sent, or it is sent and then dropped (when its confirmation finds nobody waiting, or with
    the idle channels)."""
    hub, _ = hub
    sent = await spy(hub)
    channel = f"{prefix}:gone{turns}"
    task = asyncio.create_task(hub.subscribe(channel).__aenter__())
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    for _ in range(2):  # a channel asked for goes with the next turn of the loop, or never
        await asyncio.sleep(0)
    if sent["subscribe"]:  # then dropped: on its confirmation, or with the idle channels after UNSUBSCRIBE_AFTER_S
        await sent.next_unsubscribe(UNSUBSCRIBE_AFTER_S * 4)
    assert hub.waiting == 0
    assert sent["subscribe"] == [] or sent["unsubscribe"] == [[channel]]
