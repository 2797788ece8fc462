"""A PCED group enters vLLM's scheduler whole.

Every row of a group advances one token a step, so a member admitted a step after the others
follows the group's tape forever and every later step is decided without it (degraded). In pced's
process the N+1 requests of a question are added one after another; with the engine in its own
process (vLLM's default) each add is a message, and the engine core handles the messages it has
received and then steps (``v1/engine/core.py:1573-1601``), so it may step with part of a group.
``GroupScheduler`` holds a group's requests as they arrive and hands them to vLLM's scheduler
together, in member order, once all N+1 are there; everything else is vLLM's scheduler as it is
(``AsyncGroupScheduler`` where vLLM schedules asynchronously: ``config/scheduler.py:228-235``).
Aborting a held request drops it. The prefill pass's requests (no group) pass straight through.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from .groups import GroupMember

MODULE = __name__


class GroupAdmission:
    """Mixin over a vLLM scheduler (``add_request`` / ``finish_requests``: ``v1/core/sched/scheduler.py:2616-2651``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held: dict[str, list] = {}  # group -> its requests that arrived, until all have

    def add_request(self, request) -> None:
        member = GroupMember.from_args(getattr(request.sampling_params, "extra_args", None)) \
            if request.sampling_params is not None else None
        if member is None:
            return super().add_request(request)
        arrived = self.held.setdefault(member.group, [])
        arrived.append((member.member, request))
        if len(arrived) == len(member.relevance) + 1:
            del self.held[member.group]
            for _, whole in sorted(arrived, key=lambda pair: pair[0]):
                super().add_request(whole)

    def finish_requests(self, request_ids, finished_status):
        ids = None if request_ids is None else {request_ids} if isinstance(request_ids, str) else set(request_ids)
        for group in list(self.held):
            kept = [(m, r) for m, r in self.held[group] if ids is not None and r.request_id not in ids]
            if kept:
                self.held[group] = kept
            else:
                del self.held[group]
        return super().finish_requests(request_ids, finished_status)


class GroupScheduler(GroupAdmission, Scheduler):
    pass


class AsyncGroupScheduler(GroupAdmission, AsyncScheduler):
    pass


def scheduler_class(async_scheduling: bool) -> str:
    """The scheduler to name in ``EngineArgs(scheduler_cls=...)``, by module path (it is loaded in
    vLLM's engine process: ``config/scheduler.py:251-253``)."""
    return f"{MODULE}.{'AsyncGroupScheduler' if async_scheduling else 'GroupScheduler'}"
