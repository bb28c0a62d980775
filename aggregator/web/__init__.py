"""The aggregator's pages for people: the status page (``status``) and its pictures (``svg``)."""

from aggregator.web.status import status_routes

__all__ = ["status_routes"]
