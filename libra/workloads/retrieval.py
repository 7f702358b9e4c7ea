"""Retrievers for the search tool: a local BM25 index over a corpus file, and a Search-R1 server client.

Both answer one query with at most `topk` documents and report a structured status:

- `Bm25Retriever` indexes a JSONL corpus (one ``{"contents": "\\"Title\\"\\ntext"}`` per line, the
  Search-R1/FlashRAG layout, or ``{"title": ..., "text": ...}``) with `bm25s` at first use.
- `HttpRetriever` speaks the Search-R1 retrieval-server protocol (a FastAPI server over a dense
  index)::

      POST {url}/retrieve  {"queries": ["..."], "topk": k, "return_scores": true}
      ->  {"result": [[{"document": {"id": "...", "contents": "..."}, "score": 0.83}, ...]]}

  (with ``return_scores: false`` each inner list holds the documents themselves). A refused
  connection, an HTTP error or an unexpected body is a FAILURE, a slow answer a TIMEOUT; the
  reason goes to the model and the logs, never an exception out of the tool.

This module knows nothing about turns, prompts or rewards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import threading
from typing import Any, Protocol

from libra.errors import ConfigError
from libra.workloads.base import ToolResult, ToolStatus

TOOL = "search"
MAX_QUERY_CHARS = 512


@dataclasses.dataclass(frozen=True)
class Document:
    """One retrieved passage: its title (may be empty), its text and the retriever's score."""

    title: str
    text: str
    score: float = 0.0


def split_contents(contents: str) -> tuple[str, str]:
    """Search-R1 corpora put a quoted title on the first line of `contents`."""
    head, _, rest = contents.partition("\n")
    if rest:
        return head.strip().strip('"'), rest.strip()
    return "", contents.strip()


def document_of(record: Any, score: float = 0.0) -> Document:
    """A corpus record ({"contents"} or {"title", "text"}) as a Document; ValueError if it is neither."""
    if isinstance(record, dict) and isinstance(record.get("contents"), str):
        return Document(*split_contents(record["contents"]), score=score)
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return Document(str(record.get("title", "")), record["text"], score=score)
    raise ValueError("a document needs `contents` (or `title` and `text`)")


class Retriever(Protocol):
    async def search(self, query: str, timeout_s: float) -> ToolResult: ...


def render_documents(documents: list[Document], max_chars: int) -> str:
    """The tool payload: numbered documents, each cut to `max_chars` characters."""
    if not documents:
        return "no documents found"
    lines = []
    for index, doc in enumerate(documents, start=1):
        title = f"(Title: {doc.title}) " if doc.title else " "
        lines.append(f"Doc {index}{title}{doc.text[:max_chars]}")
    return "\n".join(lines)


def _check_query(query: str) -> str:
    query = query.strip()
    if not query:
        return "empty query"
    if len(query) > MAX_QUERY_CHARS:
        return f"query longer than {MAX_QUERY_CHARS} characters"
    return ""


class Bm25Retriever:
    """BM25 (bm25s) over a JSONL corpus file; the index is built once, at first use."""

    def __init__(self, corpus: str | pathlib.Path, topk: int, max_doc_chars: int):
        self.path, self.topk, self.max_doc_chars = pathlib.Path(corpus), topk, max_doc_chars
        self.documents = self._load()
        self._index = None
        self._lock = threading.Lock()

    def _load(self) -> list[Document]:
        documents = []
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"workload.retriever.corpus: cannot read {self.path}: {error}") from None
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                documents.append(document_of(json.loads(line)))
            except (json.JSONDecodeError, ValueError) as error:
                raise ConfigError(f"workload.retriever.corpus: {self.path} line {number}: {error}; "
                                  "each line must be a JSON object with `contents` (or `title` and `text`)") from None
        if not documents:
            raise ConfigError(f"workload.retriever.corpus: {self.path} holds no documents")
        return documents

    def _ensure_index(self):
        with self._lock:
            if self._index is None:
                import bm25s

                index = bm25s.BM25()
                texts = [f"{doc.title} {doc.text}" for doc in self.documents]
                index.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
                self._index = index
            return self._index

    def search_now(self, query: str) -> list[Document]:
        """The best documents for `query` (blocking; documents that share no term are left out)."""
        import bm25s

        index = self._ensure_index()
        terms = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        if not terms or not terms[0]:
            return []
        found, scores = index.retrieve(terms, k=min(self.topk, len(self.documents)), show_progress=False)
        return [dataclasses.replace(self.documents[int(i)], score=float(s))
                for i, s in zip(found[0], scores[0]) if s > 0]

    async def search(self, query: str, timeout_s: float) -> ToolResult:
        problem = _check_query(query)
        if problem:
            return ToolResult(TOOL, ToolStatus.FAILURE, problem)
        try:
            documents = await asyncio.wait_for(asyncio.to_thread(self.search_now, query.strip()), timeout_s)
        except TimeoutError:
            return ToolResult(TOOL, ToolStatus.TIMEOUT, "search timed out")
        return ToolResult(TOOL, ToolStatus.SUCCESS, render_documents(documents, self.max_doc_chars))


class HttpRetriever:
    """Client of a Search-R1 retrieval server (POST /retrieve)."""

    def __init__(self, url: str, topk: int, max_doc_chars: int):
        self.url, self.topk, self.max_doc_chars = url.rstrip("/") + "/retrieve", topk, max_doc_chars
        self._client = None

    def _http(self):
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient()
        return self._client

    async def search(self, query: str, timeout_s: float) -> ToolResult:
        import httpx

        problem = _check_query(query)
        if problem:
            return ToolResult(TOOL, ToolStatus.FAILURE, problem)
        body = {"queries": [query.strip()], "topk": self.topk, "return_scores": True}
        try:
            response = await self._http().post(self.url, json=body, timeout=timeout_s)
        except httpx.TimeoutException:
            return ToolResult(TOOL, ToolStatus.TIMEOUT, "search timed out")
        except httpx.HTTPError as error:
            return ToolResult(TOOL, ToolStatus.FAILURE, "the retriever is unreachable",
                              detail=f"{type(error).__name__}: {error}")
        if response.status_code != 200:
            return ToolResult(TOOL, ToolStatus.FAILURE, f"the retriever answered HTTP {response.status_code}",
                              detail=response.text[:500])
        try:
            documents = parse_response(response.json())
        except ValueError as error:
            return ToolResult(TOOL, ToolStatus.FAILURE, "the retriever sent an unexpected answer", detail=str(error))
        return ToolResult(TOOL, ToolStatus.SUCCESS, render_documents(documents, self.max_doc_chars))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def parse_response(body: Any) -> list[Document]:
    """The documents of the first query of a /retrieve answer; ValueError when the shape is wrong."""
    if not isinstance(body, dict) or not isinstance(body.get("result"), list) or not body["result"]:
        raise ValueError('expected {"result": [[...]]}')
    first = body["result"][0]
    if not isinstance(first, list):
        raise ValueError("result[0] must be a list of documents")
    documents = []
    for item in first:
        if isinstance(item, dict) and "document" in item:
            score = item.get("score", 0.0)
            documents.append(document_of(item["document"], float(score) if isinstance(score, (int, float)) else 0.0))
        else:
            documents.append(document_of(item))
    return documents


def build_retriever(config: Any) -> Bm25Retriever | HttpRetriever:
    """The retriever a `RetrieverConfig` names."""
    if config.kind == "http":
        return HttpRetriever(config.url, config.topk, config.max_doc_chars)
    return Bm25Retriever(config.corpus, config.topk, config.max_doc_chars)
