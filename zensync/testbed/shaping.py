"""Link shaping with tc: rate/time parsing and the qdisc commands for one link direction.

Every host link is shaped in both directions with a token bucket filter (``tbf``): host egress on
``eth0`` inside the host namespace, and the switch-side veth egress inside the switch namespace, so
a host can neither send nor receive faster than the configured rate (a full-duplex NIC). An optional
one-way delay is added with ``netem`` as the tbf's child qdisc, on host egress only, so the delay is
the host-to-host one-way latency (the round trip is twice it).

Example::

    parse_rate("2.5gbit")  # -> 2_500_000_000 bits/s
    tbf_commands("eth0", 10**9, None)
    # [["tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "tbf", "rate", "1000000000bit", ...]]
"""

from __future__ import annotations

import re

__all__ = ["burst_bytes", "parse_rate", "parse_time_s", "tbf_commands"]

_RATE_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "bps": 8,  # tc's convention: "bps" means bytes per second
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

MIN_RATE_BITS = 8_000
"""Below 1 kB/s a tbf cannot pass one full-size frame within its latency bound."""
MIN_BURST_BYTES = 64 * 1024
"""tbf's bucket must hold at least one GSO segment burst; 64 KiB keeps veth throughput smooth."""
BURST_WINDOW_S = 1e-3
"""The bucket holds 1 ms of traffic at the link rate (bigger than MIN_BURST_BYTES above ~500 Mbit/s)."""
QUEUE_LATENCY_MS = 200
"""Queueing budget of each tbf before it drops: generous, so incast queues rather than retransmits
(drops would make wire bytes exceed the engine's count)."""


def parse_rate(rate: str | int | float) -> int:
    """Bits per second of a tc-style rate: ``"1gbit"``, ``"100mbit"``, ``"500kbit"``, ``"2.5gbit"`` or a number.

    Args:
        rate: A number of bits/s, or a string with unit bit/kbit/mbit/gbit/tbit (decimal multiples)
            or bps/kbps/mbps/gbps (bytes per second, as tc reads them). Case-insensitive.

    Returns:
        The rate in bits per second, rounded to an integer.

    Raises:
        ValueError: If the string does not parse, the unit is unknown, or the rate is below
            ``MIN_RATE_BITS``.
    """
    if isinstance(rate, bool):
        raise ValueError(f"rate={rate!r}: expected bits/s as a number or a string such as '1gbit'")
    if isinstance(rate, int | float):
        bits = float(rate)
    else:
        match = _NUMBER_UNIT.match(str(rate))
        if match is None:
            raise ValueError(f"rate={rate!r}: expected '<number><unit>' such as '1gbit', '100mbit', '2.5gbit'")
        unit = match.group(2).lower() or "bit"
        if unit not in _RATE_UNITS:
            raise ValueError(f"rate={rate!r}: unknown unit {unit!r}; valid units: {', '.join(_RATE_UNITS)}")
        bits = float(match.group(1)) * _RATE_UNITS[unit]
    if not bits >= MIN_RATE_BITS:  # also rejects NaN
        raise ValueError(f"rate={rate!r}: {bits} bits/s is below the minimum {MIN_RATE_BITS} bits/s")
    return round(bits)


def parse_time_s(value: str | int | float) -> float:
    """Seconds of a tc-style time: ``"2ms"``, ``"500us"``, ``"0.1s"``, or a number of seconds.

    Raises:
        ValueError: If it does not parse, the unit is unknown, or the time is negative or above 10 s.
    """
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _NUMBER_UNIT.match(str(value))
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _TIME_UNITS:
            raise ValueError(f"delay={value!r}: expected '<number><unit>' with unit in {', '.join(_TIME_UNITS)}")
        seconds = float(match.group(1)) * _TIME_UNITS[unit]
    if not 0.0 <= seconds <= 10.0:
        raise ValueError(f"delay={value!r}: must be between 0 and 10 s")
    return seconds


def burst_bytes(rate_bits: int) -> int:
    """Token bucket size for ``rate_bits``: ``BURST_WINDOW_S`` of traffic, at least ``MIN_BURST_BYTES``."""
    return max(MIN_BURST_BYTES, int(rate_bits / 8 * BURST_WINDOW_S))


def tbf_commands(dev: str, rate_bits: int, delay_s: float | None) -> list[list[str]]:
    """tc commands (run inside the device's namespace) that shape ``dev``'s egress.

    Step 1: a root tbf at ``rate_bits`` with bucket ``burst_bytes(rate_bits)``.
    Step 2: if ``delay_s`` is set, a netem child of the tbf delays every packet by ``delay_s``.
    """
    tbf = ["tbf", "rate", f"{rate_bits}bit", "burst", str(burst_bytes(rate_bits)), "latency", f"{QUEUE_LATENCY_MS}ms"]
    commands = [["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf]]
    if delay_s:
        delay_us = max(1, round(delay_s * 1e6))
        commands.append(
            [
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "parent",
                "1:1",
                "handle",
                "10:",
                "netem",
                "delay",
                f"{delay_us}us",
                "limit",
                "100000",
            ]
        )
    return commands
