// MathJax for pymdownx.arithmatex (generic mode), as the mkdocs-material docs set it up,
// read by the copy of MathJax shipped beside it (mathjax/tex-svg-full.js).
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  // One definition of each glyph per page, not one per formula (the gallery has
  // over a hundred).
  svg: {
    fontCache: "global",
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};

document$.subscribe(() => {
  MathJax.startup.output.clearCache();
  MathJax.typesetClear();
  MathJax.texReset();
  MathJax.typesetPromise();
});
