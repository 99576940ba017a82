"""A session's unary calls to several workers at once (Save, Load, Colocated): each
worker's answer read by its table, and one future for all of them."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import grpc

from pathways import errors
from pathways.client.fetches import GONE
from pathways.protocol import operator
from pathways.protocol.messages import Message, Table
from pathways.wire import rpc


def answer(f: Any, address: str, table: Table) -> Message:
    """The message the worker at ``address`` answered call ``f`` with (read by ``table``);
    the error it answered, or the call's failure, raised as pathways' error."""
    try:
        return operator.answer(table, f.result(), errors.RemoteError)
    except grpc.RpcError as e:
        refused = rpc.refusal(e, address)
        if refused is not None:
            raise refused from None
        if e.code() in GONE:
            raise errors.WorkerLostError(f"the worker at {address} is unreachable or stopped serving "
                                         f"({e.code().name}); `python -m pathways status` shows which islands are "
                                         "healthy") from None
        raise errors.RemoteError(f"the call to the worker at {address} failed: {e.code().name}") from None


def all_answered(calls: list[tuple[str, Any]], table: Table, what: str) -> Future:
    """One Future for the workers' ``calls`` ((address, call) pairs): the list of their
    answers in order, or the first error, naming ``what`` was done and where."""
    result: Future = Future()
    answers: list[Any] = [None] * len(calls)
    left, lock = [len(calls)], threading.Lock()
    if not calls:
        result.set_result([])

    def done(f: Any, i: int, address: str) -> None:
        try:
            answers[i], error = answer(f, address, table), None
        except errors.PathwaysError as e:
            error = type(e)(f"{what} on the worker at {address} failed: {e}")
        with lock:  # one of the callbacks, whichever thread each runs on, settles the result
            if result.done():
                return
            left[0] -= 1
            if error is not None:
                result.set_exception(error)
            elif left[0] == 0:
                result.set_result(answers)

    for i, (address, call) in enumerate(calls):
        call.add_done_callback(lambda f, i=i, address=address: done(f, i, address))
    return result
