"""What a SYN stage asks the trio runtime to do before it decides (sans-IO, spec §8
step 1): :class:`StoreStep`, a store call and the decision made from its outcome —
the stage describes it, :func:`~atp_router.runtime.dataplane.opening.run_stages`
carries it out off the loop (issue 22 item 2) —, and :func:`run_inline`, which runs a
coroutine that never suspends to its end for a caller that cannot await."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from atp_router.store.threads import off_loop

__all__ = ["StoreStep", "run_inline"]

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True, slots=True)
class StoreStep(Generic[T]):
    """What a stage asks to be done before it decides (sans-IO): ``run()``, a
    blocking call of ``store`` that touches nothing else (one of the store's
    threads may run it: :func:`~atp_router.store.threads.off_loop`), or
    ``arun()``, the same call awaited on the trio loop without blocking it
    (None: none); then ``then(outcome)`` on the trio thread — ``outcome`` is
    what the call returned or the :class:`Exception` it raised — giving the
    decision (a stage's: :data:`~atp_router.runtime.dataplane.opening.CONTINUE` or a
    :class:`~atp_router.security.authz.Refuse`)."""

    run: Callable[[], Any]
    then: Callable[[Any], T]
    store: Any
    arun: Callable[[], Awaitable[Any]] | None = None

    def outcome(self) -> Any:
        """``run()``'s result, or the exception it raised (not raised)."""
        try:
            return self.run()
        except Exception as e:  # noqa: BLE001 - handed to then(), which decides
            return e

    def deciding(self, then: Callable[[Any], U]) -> StoreStep[U]:
        """The same call, its outcome decided by ``then``."""
        return StoreStep(self.run, then, self.store, self.arun)

    async def outcome_off_loop(self) -> Any:
        """:meth:`outcome` without blocking the trio loop: ``arun()`` on it, else ``run()`` in a store thread."""
        if self.arun is None:
            return await off_loop(self.store, self.outcome)
        try:
            return await self.arun()
        except Exception as e:  # noqa: BLE001 - handed to then(), which decides
            return e


def run_inline(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end on this thread: one that never suspends (each
    await in it returns without waiting, e.g.
    :func:`~atp_router.runtime.dataplane.opening.run_stages` without ``streams``)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    coro.close()
    raise AssertionError(f"{coro!r} suspended: it was to run inline")
