"""The aggregator's pages for people: the status page (``status``) and its pictures (``svg``)."""

from aggregator.web.status import is_page, status_routes

__all__ = ["is_page", "status_routes"]
