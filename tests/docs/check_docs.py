#!/usr/bin/env python3
"""Checks the repository's Markdown documentation.

- Every relative link and image in a Markdown file resolves to a file or
  directory of the repository, and every #anchor to a heading of its target.
- Every repository path a document names in backticks (kernels/..., docs/...,
  ...) exists.
- README.md stays under 150 lines and opens with the two quick-start commands.
- docs/README.md links every document under docs/.
- Nothing names a document or a path outside the repository: an upper-case
  Markdown name (README.md, ...) is a file of the repository, a path that a
  document climbs to with ../ is one, and SPEC is named as docs/SPEC.md.

  check_docs.py [REPO_ROOT]        exit 0 when every check passes
"""
import os
import re
import sys

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                       os.path.join(os.path.dirname(__file__), '..', '..'))
SKIP_DIRS = {'.git', 'node_modules', '__pycache__', '.venv', 'venv'}
REPO_DIRS = ('kernels', 'server', 'client', 'proto', 'tests', 'bench',
             'scripts', 'deploy', 'dashboards', 'fuzz', 'docs', 'cmake',
             '.ci')
README_MAX_LINES = 150
QUICK_START = ['bash scripts/demo.sh', 'bash scripts/test.sh']

errors = []


def rel(path):
    return os.path.relpath(path, ROOT)


def walk_files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in SKIP_DIRS and not d.startswith('build'))
        for name in sorted(filenames):
            yield os.path.join(dirpath, name)


def prose_lines(text):
    """The lines of a Markdown text outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.split('\n'), 1):
        if line.lstrip().startswith('```'):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading):
    text = re.sub(r'`', '', heading.strip().lower())
    text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', text)
    text = re.sub(r'[^\w\- ]', '', text)
    return text.replace(' ', '-')


_anchors = {}


def anchors(path):
    if path not in _anchors:
        seen = {}
        result = set()
        with open(path, encoding='utf-8') as f:
            for _, line in prose_lines(f.read()):
                m = re.match(r'#{1,6}\s+(.*)', line)
                if not m:
                    continue
                base = slug(m.group(1))
                count = seen.get(base, 0)
                seen[base] = count + 1
                result.add(base if count == 0 else f'{base}-{count}')
        _anchors[path] = result
    return _anchors[path]


LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)\)')
CODE = re.compile(r'`([^`\s]+)`')


def paragraphs(text):
    """(first line number, text) of each run of non-empty prose lines, the
    lines joined by spaces, so that a link split across lines is one."""
    block, start = [], 0
    for number, line in prose_lines(text):
        if line.strip():
            if not block:
                start = number
            block.append(line.strip())
        elif block:
            yield start, ' '.join(block)
            block = []
    if block:
        yield start, ' '.join(block)


def check_markdown(path):
    with open(path, encoding='utf-8') as f:
        text = f.read()
    # The changelog names files that later changes removed.
    history = os.path.basename(path) == 'CHANGELOG.md'
    for number, para in paragraphs(text):
        where = f'{rel(path)}:{number}'
        without_code = re.sub(r'`[^`]*`', '', para)
        for target in LINK.findall(without_code):
            if re.match(r'[a-z]+:', target):
                continue
            file_part, _, anchor = target.partition('#')
            dest = (os.path.normpath(os.path.join(os.path.dirname(path),
                                                  file_part))
                    if file_part else path)
            if not os.path.exists(dest):
                errors.append(f'{where}: link to missing {target}')
            elif not dest.startswith(ROOT + os.sep):
                errors.append(f'{where}: link leaves the repository: {target}')
            elif anchor and dest.endswith('.md') and anchor not in anchors(dest):
                errors.append(f'{where}: no heading #{anchor} in {rel(dest)}')
        for token in [] if history else CODE.findall(para):
            token = token.rstrip('.,:;')
            first = token.split('/')[0]
            if first not in REPO_DIRS or '/' not in token:
                continue
            if re.search(r'[*<>{}$]|[A-Z]{3,}', token):
                continue  # a pattern or a placeholder
            if not os.path.exists(os.path.join(ROOT, token)):
                errors.append(f'{where}: names missing path {token}')


def check_readme():
    path = os.path.join(ROOT, 'README.md')
    with open(path, encoding='utf-8') as f:
        text = f.read()
    lines = text.rstrip('\n').split('\n')
    if len(lines) > README_MAX_LINES:
        errors.append(f'README.md: {len(lines)} lines, at most '
                      f'{README_MAX_LINES}')
    blocks = re.findall(r'```[a-z]*\n(.*?)```', text, re.S)
    first = blocks[0].strip().split('\n') if blocks else []
    if first != QUICK_START:
        errors.append('README.md: the first code block must be exactly the '
                      f'quick start {QUICK_START}')


def check_index():
    docs = os.path.join(ROOT, 'docs')
    with open(os.path.join(docs, 'README.md'), encoding='utf-8') as f:
        index = f.read()
    for name in sorted(os.listdir(docs)):
        if name.endswith('.md') and name != 'README.md':
            if f']({name})' not in index:
                errors.append(f'docs/README.md: does not link {name}')


OUTSIDE = [
    (re.compile(r'(?<![\w/.])SPEC\b(?!\.md)'),
     'names SPEC without docs/SPEC.md'),
]
# A document named by its upper-case file name anywhere, and a relative path
# that climbs in a Markdown document (tests and code name such paths as the
# inputs they refuse): each must name something in the repository.
DOC_NAME = re.compile(r'(?<![\w/.-])([A-Z][A-Z0-9_]*\.md)\b')
PARENT_PATH = re.compile(r'(?<![\w./$])((?:\.\./)+[\w.-]*)')


# Outside docs/, the math contract is named by its path.
SPEC_PATH = re.compile(r'(?<![\w.])(?<!docs/)SPEC\.md')


def check_outside_references():
    me = os.path.abspath(__file__)
    docs = os.path.join(ROOT, 'docs') + os.sep
    doc_names = {os.path.basename(p) for p in walk_files()
                 if p.endswith('.md')}
    for path in walk_files():
        if os.path.abspath(path) == me:
            continue
        patterns = list(OUTSIDE)
        markdown = path.endswith('.md')
        if not path.startswith(docs):
            patterns.append((SPEC_PATH, 'names SPEC.md without docs/'))
        try:
            with open(path, encoding='utf-8') as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        for number, line in enumerate(text.split('\n'), 1):
            for pattern, what in patterns:
                if pattern.search(line):
                    errors.append(f'{rel(path)}:{number}: {what}')
            for name in DOC_NAME.findall(line):
                if name not in doc_names:
                    errors.append(f'{rel(path)}:{number}: names {name}, '
                                  'not a document of the repository')
            for climb in PARENT_PATH.findall(line) if markdown else ():
                target = os.path.normpath(
                    os.path.join(os.path.dirname(path), climb))
                if (os.path.commonpath([ROOT, target]) != ROOT or
                        not os.path.exists(target)):
                    errors.append(f'{rel(path)}:{number}: names {climb}, '
                                  'not in the repository')


def main():
    for path in walk_files():
        if path.endswith('.md'):
            check_markdown(path)
    check_readme()
    check_index()
    check_outside_references()
    for error in errors:
        print(error)
    if errors:
        print(f'check_docs: {len(errors)} problem(s)')
        return 1
    print('check_docs: ok')
    return 0


if __name__ == '__main__':
    sys.exit(main())
