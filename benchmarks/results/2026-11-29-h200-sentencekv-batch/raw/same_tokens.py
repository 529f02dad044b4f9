"""The same SentenceKV tokens from two trees: the embedded model on CPU, a story and questions, two modes."""
import json, sys
import semkv
llm = semkv.LLM()
text = open("examples/scandal_in_bohemia.txt").read()
questions = ["What is the name of the woman in this story?", "Who is the king of Bohemia?", "Where does Irene Adler live?"]
out = {}
for mode, params in (("vector", {}), ("retrieving", dict(retain="sentences", score="tokens", query="current", keep_factor=1))):
    for budget in (256, 512):
        got = llm.generate([text] * len(questions), questions=questions, method="sentencekv", budget=budget,
                           max_new_tokens=48, method_params=params)
        out[f"{mode}@{budget}"] = [g.token_ids for g in got]
json.dump(out, open(sys.argv[1], "w"))
print("done", {k: [len(t) for t in v] for k, v in out.items()})
