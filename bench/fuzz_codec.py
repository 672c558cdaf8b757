"""Long fuzz run of the frame codec (spec §4): ``python bench/fuzz_codec.py --seconds 60``.

Invariants, the same as tests/unit/test_codec_fuzz.py (which runs them briefly in CI):

* ``FrameCodec.decode`` and ``StreamDecoder`` (JSON and CBOR, with and without an
  HMAC key) raise nothing but ``LocalProtocolError`` on any input;
* a frame they accept re-encodes and decodes to itself, and has canonical bytes;
* encode∘decode is the identity on valid frames, also across encodings;
* a sealed frame with one byte changed fails verification or means the same frame.

Engines: ``atheris`` (coverage-guided libFuzzer over the codec's Python code, seeded
with tests/unit/vectors/frames.json; used when ``pip install atheris`` worked) or
``hypothesis`` (the test module's properties in rounds until the time is up). The
run prints iterations and the outcome, and exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VECTORS = ROOT / "tests" / "unit" / "vectors" / "frames.json"


def run_hypothesis(seconds: float) -> int:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    sys.path.insert(0, str(ROOT / "tests" / "unit"))
    import test_codec_fuzz as props

    counts: dict[str, int] = {}

    def prop(name, *strategies):
        check = getattr(props, name)
        counts[name] = 0

        @settings(max_examples=500, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(st.tuples(*strategies))
        def run(args):
            counts[name] += 1
            check(*args)

        return run

    runs = [
        prop("check_random_bytes", st.binary(max_size=2048)),
        prop("check_mutated_frame", props.frames, props.mutations, st.integers(0, 1 << 16)),
        prop(
            "check_stream_chunks",
            st.lists(props.frames, max_size=4),
            st.lists(st.binary(max_size=64), max_size=3),
            st.lists(st.integers(0, 1 << 16), max_size=8),
        ),
        prop("check_round_trip", props.frames),
        prop("check_single_byte_mutation", props.frames, st.integers(0, 1 << 16), st.integers(1, 255)),
        prop("check_verify_arbitrary", props.any_frames),
    ]
    deadline = time.monotonic() + seconds
    rounds = 0
    passed = False
    try:
        while time.monotonic() < deadline:
            for run in runs:
                run()  # raises (after shrinking) when a property fails
            rounds += 1
        passed = True
    finally:
        for name, n in counts.items():
            print(f"{name:<30} {n:>9,} examples")
        total = sum(counts.values())
        if passed:
            print(f"OK: {total:,} examples in {rounds} rounds, only LocalProtocolError raised")
        else:
            print(f"FAIL after {total:,} examples: the falsifying example and traceback follow")
    return 0


def run_atheris(seconds: float) -> int:
    import atheris

    with atheris.instrument_imports():
        from atp_router.wire import codec as codec_mod
    from atp_router.wire.errors import LocalProtocolError

    FrameCodec, StreamDecoder = codec_mod.FrameCodec, codec_mod.StreamDecoder
    doc = json.loads(VECTORS.read_text("utf-8"))
    key = doc["hmac_key_utf8"].encode()
    codecs = [
        FrameCodec("json", hmac_key=key),
        FrameCodec("cbor", hmac_key=key),
        FrameCodec("json", require_checksum=False),
        FrameCodec("cbor", require_checksum=False),
    ]
    plain = {"json": FrameCodec("json", require_checksum=False), "cbor": FrameCodec("cbor", require_checksum=False)}

    def accepted(frame, encoding):
        codec_mod.canonical_bytes(frame)
        again = plain[encoding].decode(plain[encoding].encode(frame, seal_frame=False))
        if again != frame:
            raise AssertionError(f"accepted frame does not round-trip: {frame!r} -> {again!r}")

    def one_input(data: bytes) -> None:
        if len(data) < 2:
            return
        mode, chunk, body = data[0], data[1] + 1, data[2:]
        codec = codecs[mode % 4]
        if mode & 4:
            sd = StreamDecoder(codec)
            stream = StreamDecoder.frame_bytes(body) + body[:chunk]
            for i in range(0, len(stream), chunk):
                sd.receive_data(stream[i : i + chunk])
                while True:
                    try:
                        frame = sd.next_frame()
                    except LocalProtocolError as e:
                        if e.reason.startswith("announced frame length"):
                            return
                        continue
                    if frame is None:
                        break
                    accepted(frame, codec.encoding)
            return
        try:
            frame = codec.decode(body)
        except LocalProtocolError:
            return
        accepted(frame, codec.encoding)

    corpus = Path(tempfile.mkdtemp(prefix="atp-fuzz-corpus-"))
    for i, v in enumerate(doc["vectors"]):
        for mode, wire in enumerate([v["wire_json"].encode(), bytes.fromhex(v["wire_cbor"])] * 2):
            for stream in (0, 4):
                (corpus / f"{i}-{mode}-{stream}").write_bytes(bytes([mode | stream, 7]) + wire)
    artifacts = Path(tempfile.gettempdir()) / "atp-fuzz-artifacts"
    artifacts.mkdir(exist_ok=True)
    print(f"atheris: corpus {corpus}, crash artifacts under {artifacts}/ ; libFuzzer prints 'Done N runs'")
    sys.stdout.flush()
    atheris.Setup(
        [
            sys.argv[0],
            f"-max_total_time={int(seconds)}",
            "-max_len=4096",
            "-print_final_stats=1",
            f"-artifact_prefix={artifacts}/",
            str(corpus),
        ],
        one_input,
    )
    atheris.Fuzz()  # exits the process: 0 when the time is up, non-zero on a crash
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to fuzz")
    ap.add_argument("--engine", choices=["auto", "atheris", "hypothesis"], default="auto")
    args = ap.parse_args(argv)
    engine = args.engine
    if engine == "auto":
        try:
            import atheris  # noqa: F401
        except ImportError:
            engine = "hypothesis"
        else:
            engine = "atheris"
    print(f"fuzzing the frame codec for {args.seconds:.0f} s with {engine}")
    return run_atheris(args.seconds) if engine == "atheris" else run_hypothesis(args.seconds)


if __name__ == "__main__":
    raise SystemExit(main())
