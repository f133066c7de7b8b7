"""Dataset-scale audits: run read-outs over many image-question pairs.

``vlm-readout audit --model SPEC --dataset DIR_OR_JSONL --methods answer,lens,attention,dla,rollout --out DIR``
runs one capture per batch of samples and, for each sample, the read-outs
that ``analyze`` gives for one (the answer, the logit lens at the answer
position, each head's mass on the visual tokens / the sink / the target
region, the residual stream's largest frozen-scale DLA components, rollout
mass) and, with ``counterfactual``, the answer effect of filling each
sample's target mask (one batched forward of the edited images; the routing
mass of the same region sits beside it). Methods are pluggable: an
:class:`AuditMethod` subclass given to :func:`register_method`; an unknown
name is a one-line error. The read-outs are the registry's
(:mod:`core.readouts`), the ones ``analyze`` runs on one sample: each
sample's section is the read-out's analyze section, kept in its compact
audit form (:meth:`core.readouts.base.ReadoutMethod.audit_section`). The run
writes to ``DIR``:

* ``samples.csv`` (one flat row per sample) and ``samples.jsonl`` (one JSON
  object per sample, every number the read-outs gave); long tables
  ``heads.csv`` (attention), ``lens.csv`` (lens), ``components.csv``
  (DLA top components); ``samples.parquet`` too when pyarrow is importable;
* ``summary.json`` / ``summary.md``: distributions (quantiles, histograms)
  over the samples the model got right, got wrong, and all of them; error
  counts;
* ``audit.csv`` / ``audit.md`` / ``audit.json``: one audit row per method,
  with this run's parameters (docs/METHODS.md §4.13);
* ``run.json``: how the run went (processes, device, time, completed or
  cancelled). It is the only file that differs between a one-process run
  and a sharded one.

Every file is written atomically (temporary file, then ``os.replace``). The
first Ctrl-C stops the run after the current batch and writes what is done
(``summary.json``: ``cancelled``; ``run.json``: ``complete: false``; exit 130);
a second one aborts.

Dataset: a pairs file (:func:`core.files.pairs.read_pairs`): a JSONL file, or a
folder holding ``dataset.jsonl`` (as :mod:`core.zoo.dataset` writes it) or
exactly one ``*.jsonl``. Each line is
``{"image": PATH, "question": TEXT}`` plus optional ``answer``, ``foil``,
``kind``, ``template``, ``target_mask`` (a PNG, white = the region; same size
as the image) and ``id``. Relative paths are relative to the JSONL file.
A sample whose image or mask cannot be read, or whose question or answer does
not fit the model, becomes an error row (``status = "error"``) and the run
goes on; the summary counts the errors and the command's last line says how
many failed. A run in which no sample succeeded is a failed run: one
``error:`` line naming the first failure, exit 2, nothing written.

Target: the lens, DLA and answer numbers track the dataset's ``answer``
(minus its ``foil`` where given); without an answer, the model's own top
token. ``correct`` is whether the model's top token is the dataset's answer.

Scaling out: ``--device auto`` loads one model across the GPUs with
``device_map="auto"`` (Hugging Face families; needs the ``accelerate``
package), in one process (refused under a launcher). Launched by ``torchrun`` or
``accelerate launch`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set), the same
command shards the work: the samples are cut into consecutive batches of
``--batch-size`` and process ``rank`` takes batches ``k`` with
``k % world_size == rank`` (with batch size 1: samples ``i % world == rank``),
so every batch is the one a single process would run. Rank 0 gathers the
records (``gather_object``) and writes the outputs a single process would
write, in the same sample order. Backend: NCCL when the model runs on CUDA
(``--device cuda``: rank r takes ``cuda:LOCAL_RANK``), gloo on CPU. With the
same batch size, device type and thread settings the merged files are
byte-identical to a one-process run.

The package, lowest first: ``dataset`` (the pairs, masks, token cover),
``methods`` (``--methods``: the registry's dataset-scale read-outs),
``batches`` (one batch: records, the forward, every read-out), ``sharding``
(shards, merge, launcher environment, gather), ``summaries`` (distributions,
routing against effect, the audit table, ``summary.md``), ``outputs`` (the
files). Every public name is re-exported here; the ones that need torch
(batches, sharding, outputs) load when first used, so that the audit command's
``--methods`` help reads :data:`METHODS` without importing torch.
"""

from __future__ import annotations

from core.dataset_audit.methods import DEFAULT_METHODS, METHODS, parse_methods
from core.readouts import ReadoutMethod, ReadoutOptions, SampleContext, register_method
from core.readouts.answer import AnswerReadout
from core.readouts.attention import AttentionReadout
from core.readouts.counterfactual import CounterfactualReadout
from core.readouts.logit_lens import LensReadout
from core.readouts.residual import DlaReadout
from core.readouts.rollout import RolloutReadout
from core.shell.lazy import lazy_getattr

AuditMethod = ReadoutMethod  # the name a dataset read-out (a plugin) subclasses
AuditOptions = ReadoutOptions  # what every method of one run is run with

_LAZY = {
    "base_record": "batches",
    "error_record": "batches",
    "run_batch": "batches",
    "run_chunk": "batches",
    "DatasetItem": "dataset",
    "dataset_file": "dataset",
    "read_dataset": "dataset",
    "token_cover": "dataset",
    "BASE_COLUMNS": "outputs",
    "SCHEMA_VERSION": "outputs",
    "sample_rows": "outputs",
    "write_outputs": "outputs",
    "ShardResult": "sharding",
    "dist_env": "sharding",
    "gather": "sharding",
    "merge_shards": "sharding",
    "run_shard": "sharding",
    "shard_chunks": "sharding",
    "DATASET_CONTROLS": "summaries",
    "audit_table": "summaries",
    "format_number": "summaries",
    "routing_vs_effect": "summaries",
    "summarize": "summaries",
    "summary_markdown": "summaries",
}


__getattr__ = lazy_getattr(__name__, {name: f"{__name__}.{module}" for name, module in _LAZY.items()})


__all__ = [
    "DEFAULT_METHODS",
    "METHODS",
    "AnswerReadout",
    "AttentionReadout",
    "AuditMethod",
    "AuditOptions",
    "CounterfactualReadout",
    "DlaReadout",
    "LensReadout",
    "RolloutReadout",
    "SampleContext",
    "parse_methods",
    "register_method",
    *_LAZY,
]
