"""The gateway's channels to replicas announce a fixed stream window (``stream_window.py``)."""

from __future__ import annotations

from ray.serve._private.request_router import replica_wrapper

from serve_app.backends import stream_window


def test_channels_opened_for_replica_calls_get_a_fixed_window_once(monkeypatch):
    opened = []

    def opener(address, options=None, asynchronous=False, credentials=None):
        opened.append((address, dict(options or ()), asynchronous))
        return "channel"

    monkeypatch.setattr(replica_wrapper, "init_grpc_channel", opener)
    assert stream_window.bound_stream_windows()
    assert stream_window.bound_stream_windows()  # a second pool's backend: wrapped once
    channel = replica_wrapper.init_grpc_channel(
        "10.0.0.1:9000", options=[("grpc.max_receive_message_length", 7)], asynchronous=True
    )
    assert channel == "channel"
    ((address, options, asynchronous),) = opened
    assert (address, asynchronous) == ("10.0.0.1:9000", True)
    assert options == {
        "grpc.max_receive_message_length": 7,  # Serve's own, kept
        "grpc.http2.bdp_probe": 0,
        "grpc.http2.lookahead_bytes": stream_window.STREAM_WINDOW_BYTES,
    }


def test_the_replica_client_still_opens_its_channels_through_the_wrapped_function():
    """If Serve stops calling ``init_grpc_channel`` by this name, wrapping it bounds nothing:
    fail here rather than let the bound quietly lapse."""
    import inspect

    source = inspect.getsource(replica_wrapper)
    assert "init_grpc_channel(" in source and "import init_grpc_channel" in source
