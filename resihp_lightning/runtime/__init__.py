"""The DeepSpeed side of one plan on one process group: engine, pipeline module, topology, layer-wise
gradient reduction, profiling, batching, link probes and plan rules (:class:`~.pipeline_runtime.PipelineRuntime`
owns every plan-dependent object). No Lightning here."""
