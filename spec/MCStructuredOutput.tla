------------------------- MODULE MCStructuredOutput -------------------------
(* Small models of StructuredOutput for TLC. spec/manifest.json lists every .cfg *)
(* that uses this module, with its expected result and distinct-state count.    *)
EXTENDS StructuredOutput

\* One unconstrained request beside two constrained ones: batches mix them, and a bitmask indexed by
\* batch row instead of request id gives a row another request's mask.
MCRequests == <<"a", "b", "c">>
MCConstrained == {"b", "c"}
MCMaxTokens == [r \in {"a", "b", "c"} |-> IF r = "b" THEN 3 ELSE 2]
=============================================================================
