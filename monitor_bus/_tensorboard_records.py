"""TensorBoard's records, built from the ``tensorboard`` package's own protos: a scalar's
summary value and the event around it at a step, the HPARAMS plugin's session and experiment
records and the CUSTOM SCALARS plugin's layout (without their TensorFlow API), and the text
table a run's start and end are written as.

Guarantees
----------
- A record is whole or not made: a bad tag (not a str, not UTF-8), value (not a real number,
  an int beyond float64) or step (not an int, outside int64) raises a ``TypeError`` or
  ``ValueError`` naming it before anything is written.
- Needs the ``tensorboard`` extra, as ``monitor_bus.tensorboard`` does (its only importer).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from tensorboard.compat.proto import (  # type: ignore[import-untyped]
    event_pb2,
    summary_pb2,
    tensor_pb2,
    tensor_shape_pb2,
)
from tensorboard.plugins.custom_scalar import (  # type: ignore[import-untyped]
    layout_pb2,
)
from tensorboard.plugins.custom_scalar import metadata as custom_scalar_metadata
from tensorboard.plugins.hparams import (  # type: ignore[import-untyped]
    api_pb2,
    plugin_data_pb2,
)
from tensorboard.plugins.hparams import metadata as hparams_metadata

from ._skipped import INT64_MAX, INT64_MIN, is_utf8


def check_tag(tag: Any) -> None:
    if not isinstance(tag, str):
        raise TypeError(f"tag must be a str, not {type(tag).__name__}")
    if not is_utf8(tag):
        raise ValueError(f"tag {tag!r} is not valid UTF-8, which event files need")


def summary_value(tag: Any, scalar_value: Any, new_style: bool, double_precision: bool) -> Any:
    check_tag(tag)
    try:
        value = float(scalar_value)
    except (TypeError, ValueError):
        raise TypeError(
            f"scalar_value must be a real number, not {type(scalar_value).__name__}"
        ) from None
    except OverflowError:
        raise ValueError("scalar_value is an int beyond float64's range") from None
    if not new_style:
        return summary_pb2.Summary.Value(tag=tag, simple_value=value)
    if double_precision:
        tensor = tensor_pb2.TensorProto(dtype="DT_DOUBLE", double_val=[value])
    else:
        tensor = tensor_pb2.TensorProto(dtype="DT_FLOAT", float_val=[value])
    metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
    )
    return summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=metadata)


def step_event(value: Any, global_step: Any, walltime: float | None) -> Any:
    event = event_pb2.Event(
        wall_time=time.time() if walltime is None else float(walltime),
        summary=summary_pb2.Summary(value=[value]),
    )
    if global_step is not None:
        if isinstance(global_step, bool):
            raise TypeError("global_step must be an int, not bool")
        try:
            step = int(global_step.__index__())
        except (AttributeError, TypeError):
            raise TypeError(
                f"global_step must be an int, not {type(global_step).__name__}"
            ) from None
        if not INT64_MIN <= step <= INT64_MAX:
            raise ValueError(f"global_step {step} is outside int64, the event file's step type")
        event.step = step
    return event


# -- the HPARAMS plugin's records (tensorboard.plugins.hparams, without its TensorFlow API) --

_STATUS = {
    "success": api_pb2.Status.STATUS_SUCCESS,
    "failed": api_pb2.Status.STATUS_FAILURE,
    "interrupted": api_pb2.Status.STATUS_FAILURE,
}


def _hparams_value(value: Any) -> Any:
    if isinstance(value, bool):
        return {"bool_value": value}
    if isinstance(value, (int, float)):
        return {"number_value": float(value)}
    return {"string_value": value if isinstance(value, str) else str(value)}


def _plugin_value(tag: str, data: Any) -> Any:
    return summary_pb2.Summary.Value(
        tag=tag,
        metadata=hparams_metadata.create_summary_metadata(data),
        tensor=hparams_metadata.NULL_TENSOR,
    )


def session_start(hparams: Mapping[str, Any], start_time: float) -> Any:
    """The HPARAMS plugin's session-start record of ``hparams`` (a ``Summary.Value``)."""
    info = plugin_data_pb2.SessionStartInfo(start_time_secs=start_time)
    for name, value in hparams.items():
        for field, plain in _hparams_value(value).items():
            setattr(info.hparams[str(name)], field, plain)
    return _plugin_value(
        hparams_metadata.SESSION_START_INFO_TAG,
        plugin_data_pb2.HParamsPluginData(session_start_info=info),
    )


def session_end(status: str, end_time: float) -> Any:
    """The HPARAMS plugin's session-end record for a run status (``RUN_STATUSES``)."""
    info = plugin_data_pb2.SessionEndInfo(
        status=_STATUS.get(status, api_pb2.Status.STATUS_UNKNOWN), end_time_secs=end_time
    )
    return _plugin_value(
        hparams_metadata.SESSION_END_INFO_TAG,
        plugin_data_pb2.HParamsPluginData(session_end_info=info),
    )


def experiment(
    hparams: Mapping[str, Any], metrics: Mapping[str, Any], domains: Mapping[str, list[Any]]
) -> Any:
    infos = []
    for name, value in hparams.items():
        info = api_pb2.HParamInfo(name=str(name))
        kind = next(iter(_hparams_value(value)))
        info.type = {
            "bool_value": api_pb2.DATA_TYPE_BOOL,
            "number_value": api_pb2.DATA_TYPE_FLOAT64,
            "string_value": api_pb2.DATA_TYPE_STRING,
        }[kind]
        for option in domains.get(name, ()):
            info.domain_discrete.values.add(**_hparams_value(option))
        infos.append(info)
    experiment = api_pb2.Experiment(
        hparam_infos=infos,
        metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=key)) for key in metrics],
    )
    return _plugin_value(
        hparams_metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(experiment=experiment)
    )


def custom_scalars(layout: Mapping[str, Mapping[str, Sequence[Any]]]) -> Any:
    """The CUSTOM SCALARS plugin's layout record (a ``Summary.Value``), from torch's form of a
    layout: category -> chart title -> ``["Multiline", [tag regexes]]`` or
    ``["Margin", [value tag, lower tag, upper tag]]``.

    Raises:
        TypeError, ValueError: ``layout`` is not of that form (the message says where).
    """
    if not isinstance(layout, Mapping):
        raise TypeError(f"layout must be a mapping, not {type(layout).__name__}")
    categories = []
    for category, charts in layout.items():
        if not isinstance(charts, Mapping):
            raise TypeError(f"layout[{category!r}] must be a mapping of chart titles")
        made = []
        for title, spec in charts.items():
            kind, tags = spec if isinstance(spec, (list, tuple)) and len(spec) == 2 else ("", [])
            tags = [str(tag) for tag in tags]
            if kind == "Multiline" and tags:
                content = {"multiline": layout_pb2.MultilineChartContent(tag=tags)}
            elif kind == "Margin" and len(tags) == 3:
                series = layout_pb2.MarginChartContent.Series(
                    value=tags[0], lower=tags[1], upper=tags[2]
                )
                content = {"margin": layout_pb2.MarginChartContent(series=[series])}
            else:
                raise ValueError(
                    f"layout[{category!r}][{title!r}] must be ['Multiline', [tags]] or"
                    f" ['Margin', [value, lower, upper]], got {spec!r}"
                )
            made.append(layout_pb2.Chart(title=str(title), **content))
        categories.append(layout_pb2.Category(title=str(category), chart=made))
    tensor = tensor_pb2.TensorProto(
        dtype="DT_STRING",
        string_val=[layout_pb2.Layout(category=categories).SerializeToString()],
        tensor_shape=tensor_shape_pb2.TensorShapeProto(),
    )
    return summary_pb2.Summary.Value(
        tag=custom_scalar_metadata.CONFIG_SUMMARY_TAG,
        tensor=tensor,
        metadata=custom_scalar_metadata.create_summary_metadata(),
    )


def plain_event(value: Any, walltime: float) -> Any:
    return event_pb2.Event(wall_time=walltime, summary=summary_pb2.Summary(value=[value]))


def table(data: Mapping[str, Any]) -> str:
    rows = "\n".join(f"| {key} | {_cell(value)} |" for key, value in data.items())
    return f"| key | value |\n| --- | --- |\n{rows}"


def _cell(value: Any) -> str:
    """A table cell: a float to six significant digits (a duration of 8.23900027000002 s
    reads 8.239), anything else as it is."""
    return f"{value:.6g}" if value.__class__ is float else str(value)
