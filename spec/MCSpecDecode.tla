---------------------------- MODULE MCSpecDecode ----------------------------
(* Small models of SpecDecode for TLC. spec/manifest.json lists every .cfg    *)
(* that uses this module, with its expected result and distinct-state count. *)
EXTENDS SpecDecode

\* Two requests, K = 2: a runs out of max_tokens inside a run, b runs near max_model_len (its
\* speculation turns off after one spec row), so a plain row follows a drafting one.
MCRequests == <<"a", "b">>
MCMaxTokens == [r \in {"a", "b"} |-> IF r = "a" THEN 3 ELSE 4]
MCRoom == [r \in {"a", "b"} |-> IF r = "a" THEN 6 ELSE 5]
\* A client may abort a; b arrives after the first step (it may be admitted at any turn of the loop).
MCMayAbort == {"a"}
MCLate == {"b"}
=============================================================================
