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

\* TLC must find nothing to start from; used by the generated cross-check modules (ASSUMEs only).
NoInit == Init /\ FALSE
=============================================================================
