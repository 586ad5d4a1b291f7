"""RULER's task prompts, answer prefixes and generation caps (NVIDIA/RULER, ``synthetic``).

The prompt texts are RULER's own (``scripts/data/synthetic/constants.py``): a benchmark is its
prompts, so they are reproduced word for word. A prefix starts with a space: RULER appends it
right after the question (or after the chat template's assistant header). ``{context}`` is the
haystack, ``{query}`` the asked key(s) or value.
"""

from __future__ import annotations

NIAH = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to "
        "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are "
        "all the special magic {type_needle_v} for {query} mentioned in the provided text?")
NIAH_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."

VT = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
      "{context}\nQuestion: Find all variables that are assigned the value {query} in the text "
      "above.")
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, "
             "{num_v} variables are assigned the value {query}, they are: ")

CWE = ("Below is a numbered list of words. In these words, some appear more often than others. "
       "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most "
       "common words in the above list?")
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"

FWE = ("Read the following coded text and track the frequency of each coded word. Find the three "
       "most frequently appeared coded words. {context}\nQuestion: Do not provide any "
       "explanation. Please ignore the dots '....'. What are the three most frequently appeared "
       "words in the above coded text?")
FWE_PREFIX = (" Answer: According to the coded text above, the three most frequently appeared "
              "words are:")

QA = ("Answer the question based on the given documents. Only give me the answer and do not "
      "output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the "
      "question based on the given documents. Only give me the answer and do not output any "
      "other words.\n\nQuestion: {query}")
QA_PREFIX = " Answer:"
QA_DOCUMENT = "Document {i}:\n{document}"

# Tokens generated per task family (RULER's ``tokens_to_generate``).
TOKENS_TO_GENERATE = dict(niah=128, vt=30, cwe=120, fwe=50, qa=32)


def singular(text: str) -> str:
  """RULER's rewrite of a NIAH template when one value is asked (``num_q * num_v == 1``)."""
  for plural, one in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
    text = text.replace(plural, one)
  return text


def niah_texts(type_needle_v: str, query: str, one_value: bool) -> tuple[str, str]:
  """``(template with {context}, answer prefix)`` of a NIAH task, singular when ``one_value``."""
  template, prefix = NIAH, NIAH_PREFIX
  if one_value:
    template, prefix = singular(template), singular(prefix)
    type_needle_v = type_needle_v[:-1]
  fill = dict(type_needle_v=type_needle_v, query=query, context="{context}")
  return template.format(**fill), prefix.format(**fill)
