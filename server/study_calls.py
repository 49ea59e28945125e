"""The Admin calls on studies (`fedgpu studies ...`), part of the Admin service
(server/admin_service.py mixes them in): they pass the same guard, which admits admins only
for the changes (server/permissions.py) and writes each call to the audit log with the study
as its target and the sites as its detail."""

from __future__ import annotations

from typing import Any

import grpc

from fedgpu.core import jsondoc
from fedgpu.core.errors import FedgpuError
from fedgpu.proto import admin_pb2
from fedgpu.server.admin_guard import guarded
from fedgpu.server.auth import Caller
from fedgpu.server.studies import Studies, StudyError


class StudyCalls:
    """Mixed into AdminService, which provides `jobs`, `_caller`, `_noted` and `_json`."""

    jobs: Any

    def _caller(self) -> Caller:
        raise NotImplementedError  # AdminService's

    def _noted(self, **fields: str) -> None:
        raise NotImplementedError  # AdminService's

    @staticmethod
    def _json(doc: Any) -> admin_pb2.JsonReply:
        return admin_pb2.JsonReply(json=jsondoc.dumps(doc))

    def _refuse_unknown_studies(self, names: list[str] | tuple[str, ...]) -> None:
        """Once studies exist, a person's or a job's study must be one of them (before the
        first, a study is a label only)."""
        studies = getattr(self.jobs, "studies", None)
        unknown = studies.unknown(list(names)) if studies is not None else []
        if unknown:
            raise StudyError(f"no study {', '.join(map(repr, unknown[:5]))} on this "
                             "aggregator; 'fedgpu studies list' shows them, 'fedgpu studies "
                             "create NAME' makes one")

    def _studies(self) -> Studies:
        studies = getattr(self.jobs, "studies", None)
        if studies is None:
            raise FedgpuError("this aggregator keeps no studies")
        return studies

    def _nodes_by_name(self) -> dict[str, Any]:
        return {n.name: n for n in self.jobs.registry.all()}

    @guarded
    async def CreateStudy(self, request: admin_pb2.CreateStudyRequest,
                          context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        study = self._studies().create(request.name, by=self._caller().actor)
        return self._json({"study": study.to_dict()})

    @guarded
    async def EnrolSites(self, request: admin_pb2.EnrolSitesRequest,
                         context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        sites = list(request.sites)
        self._noted(detail="enrol " + ", ".join(s[:128] for s in sites[:20]))
        study = self._studies().enrol(request.name, sites,
                                      by=self._caller().actor,
                                      nodes=self._nodes_by_name())
        unknown = [s for s in sites if s not in self._nodes_by_name()]
        return self._json({"study": study.to_dict(),
                           "not_registered": unknown})

    @guarded
    async def WithdrawSites(self, request: admin_pb2.EnrolSitesRequest,
                            context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        sites = list(request.sites)
        self._noted(detail="withdraw " + ", ".join(s[:128] for s in sites[:20]))
        study = self._studies().withdraw(request.name, sites)
        return self._json({"study": study.to_dict()})

    @guarded
    async def RemoveStudy(self, request: admin_pb2.CreateStudyRequest,
                          context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        study = self._studies().remove(request.name)
        return self._json({"removed": study.to_dict()})

    @guarded
    async def ListStudies(self, request: admin_pb2.ListStudiesRequest,
                          context: grpc.aio.ServicerContext) -> admin_pb2.JsonReply:
        alive = {n.name for n in self.jobs.registry.alive()}
        out = [{**s.to_dict(), "alive": sorted(set(s.sites) & alive)}
               for s in self._studies().all()]
        return self._json({"studies": out})
