"""kvedit's benchmarks: run each from the repository root as ``python -m benchmarks.NAME``
(``--help`` says its options; ``benchmarks/README.md`` says how long each takes). Not part of the
installed package.

Speed and memory:

* ``reuse``: time to first token of a prefill against a stored state, a KVStore and a blend.
* ``steer_speed``: decode throughput and prefill peak memory, steered against unsteered.
* ``integrity_cost``: capture, extend, save, load and publish of a state, and a question over a
  loaded state against one over the state in memory (what the seal and checks cost).
* ``packed_memory``: peak memory of ``generate`` from quantized and merged states.
* ``compression_memory``: bytes a compressed cache holds on the lost-in-the-middle prompts.
* ``focus_cost``: seconds of focus (scoring, edit, guarded answer) next to ``none``.
* ``decode_pair``: the unedited and the edited answer decoded as one batch of two against one
  after the other (question pass, decode step).
* ``memory_speed``: time to first token per turn of a ``kvedit.Memory`` against re-reading the
  transcript and a bare extend; tokens run per message, peak RSS, bytes.
* ``memory_budget``: a ``kvedit.Memory`` under ``max_bytes`` over a long conversation: bytes
  after every message against the budget, forgetting's cost per message against the message's.
* ``attention``: kvedit's Triton attention kernel against torch and flash-attn (GPU).
* ``gpu_e2e``: steered generation of 8B- and 4B-shaped models against unsteered (GPU).
* ``gpu_seam_check``: the attention seam on CUDA: unsteered bit-identical, exact continuation.
* ``vllm_reuse``: vLLM serving a published cache against computing the context (vLLM venv).
* ``vllm_serve``: vLLM's answers from edited caches against kvedit's own (vLLM venv).
* ``memory_serve``: conversations through the openai client, ``kvedit serve``'s memories against
  vLLM's prefix cache: TTFT per turn, tokens computed, bytes held (vLLM venv).
* ``memory_serve_exact``: a conversation served by ``kvedit serve`` against the same one in an
  in-process ``kvedit.Memory``: answers and entries turn by turn (vLLM venv).
* ``memory_serve_recall``: facts conversations through ``kvedit serve`` under a byte budget
  against an in-process ``kvedit.Memory`` with the same budget: questions answered (vLLM venv).
* ``memory_serve_past_window``: ``memory_past_window``'s conversation through ``kvedit serve``
  under 2,048 entries a layer against an in-process ``kvedit.Memory`` (vLLM venv).
* ``memory_serve_pads``: those questions in process over padded caches (null, calibrated, masked).

Accuracy:

* ``blend_curve``: accuracy and speed-up of ``kvedit.blend``'s rules across recompute fractions.
* ``focus_scale``: focus at 20 to 300 passages, and on questions no passage answers (the
  wordings of its records: ``focus_wordings``).
* ``focus_abstain``: attention shares of relevant and unrelated questions, per abstain threshold.
* ``focus_no_harm``: #28's no-harm, hit-rate and ceiling table from eval runs (no model).
* ``memory_focus``: ``Memory.ask`` with and without focus on facts stated early, middle, late.
* ``memory_table``: one table from several ``kvedit eval memory`` runs, each method against
  ``reuse`` (no model).
* ``chat_lockin``: a scripted live chat under a budget (``Memory.ask`` turn by turn): distinct
  answers, the longest run of one repeated answer, facts recalled, entries each layer holds.
* ``memory_extend``: ``Memory.extend`` of many messages against one ``add`` each: times, passes,
  the same digest.
* ``memory_past_window``: a facts conversation four times the model's positions in a 2,048-entry
  memory (compact positions at the limit): no refusal, the cost, recall of the held facts past
  and inside the window.
* ``forget_diagnosis``: the memory's conversations compressed once after the last message, by
  score (``reconstruct``, ``kvzip``, per-message ``arrival``, ``learned``) and by how the budget
  is shared (per layer, across layers, across layers and KV heads).
* ``kvpress_peer``: kvpress's KVzipPress and SnapKVPress on ``kvedit eval memory``'s
  ``nq-shared`` conversations at the same budgets (kvpress venv).
* ``litm_engines``: one lost-in-the-middle run answered by kvedit and by vLLM (vLLM venv).

Tools:

* ``tuning``: one-off tuning measurements whose findings the reports hold (``focus_recheck``,
  ``guard_words``, ``answer_prefix``; ``benchmarks/tuning/README.md``).
* ``make_custom_records``: writes a records dataset the suite has never seen, for ``--data``.
* ``compare_predictions``: whether two runs of ``smoke_predictions.sh`` answered identically.
* ``common``: what the benchmarks share (options, timing, peak memory, atomic output files).

Shell scripts: ``benchmarks/gpu_check.sh`` (the GPU check: kernel tests, seam, attention, end to
end) and ``benchmarks/smoke_predictions.sh OUT`` (eval runs whose predictions a refactor must
not change).
"""
