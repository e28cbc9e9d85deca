"""Sinks that send events off the machine, to engines people already run.

Each exporter lives in its own module and imports its library only when used, so importing
``monitor_bus`` (or this package) needs none of them:

- ``monitor_bus.exporters.otel.OpenTelemetryEventHandler``: metrics and logs through the
  OpenTelemetry SDK (extra ``otel``), to an OpenTelemetry Collector or any OTLP receiver.
- ``monitor_bus.exporters.prometheus.PrometheusEventHandler``: gauges in a
  ``prometheus_client`` registry, served for Prometheus to scrape (extra ``prometheus``).
"""

from __future__ import annotations
