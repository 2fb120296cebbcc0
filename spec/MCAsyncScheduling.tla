------------------------- MODULE MCAsyncScheduling -------------------------
(* Small models of AsyncScheduling for TLC. spec/manifest.json lists every .cfg *)
(* that uses this module, with its expected result and distinct-state count.   *)
EXTENDS AsyncScheduling

\* Three requests are the fewest for which condense() reorders a same-set batch.
MCRequests == <<"a", "b", "c">>
MCMaxTokens == [r \in {"a", "b", "c"} |-> IF r = "b" THEN 3 ELSE 2]
\* A step of 1 or 3 decodes is padded (to 2 or 4): the first decode after a prefill mismatches.
MCBuckets == {2, 4}

\* Two requests: enough for both threads to race on every output, small enough for liveness.
MCLivenessRequests == <<"a", "b">>
MCLivenessMaxTokens == [r \in {"a", "b"} |-> 2]

\* Request liveness: three requests, two slots (one waits for a slot), short outputs.
MCRequestLivenessMaxTokens == [r \in {"a", "b", "c"} |-> IF r = "b" THEN 2 ELSE 1]

\* Witness models: outputs long enough for two requests to settle into Steady decoding after the
\* first leaves (MCMaxTokens reaches no Steady pair, and not every path state with an abort and an EOS).
MCWitnessMaxTokens == [r \in {"a", "b", "c"} |-> IF r = "a" THEN 2 ELSE 4]
MCSteadyMaxTokens == [r \in {"a", "b", "c"} |-> 4]
\* Only requests that may not be aborted stop on EOS: an early stop of "b" is then an abort.
MCStopNotAborted == {"a", "c"}

\* vLLM's engine core drives the worker (EngineCore); under its uni-process executor the engine
\* thread also calls get_output() in order (OutputOnEngineThread).
MCVllm == "vllm"
MCOutputOnEngineThread == TRUE
\* Structured output: b samples under a grammar (and may be aborted), so its steps launch and defer.
MCConstrained == {"b"}

\* Speculation with a host-side drafter (n-gram): HostDraftBreak takes every step with a pending future.
MCHostDrafter == TRUE

\* Speculation with a drafter on the device (draft_model): every program drafts; SpecSteady and SpecExit.
MCDeviceDrafter == TRUE
MCDeviceDraftMaxTokens == [r \in {"a", "b"} |-> IF r = "a" THEN 2 ELSE 3]
MCSpecWitnessMaxTokens == [r \in {"a", "b", "c"} |-> IF r = "c" THEN 1 ELSE 3]

\* TLC must find nothing to start from; used by the generated cross-check modules (ASSUMEs only).
NoInit == Init /\ FALSE
=============================================================================
